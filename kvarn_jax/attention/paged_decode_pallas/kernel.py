"""The decode program: an fp32 online softmax over a sequence's quantized tiles (a split of them)
and its share of the high-precision sink and tail chunks (float values, or int8 codes with a scale
and zero point per token), for the query heads of one kv head. What each
scheme's tile costs is the layout plan's (`layout.py`); the launch decides the static parameters
(`launch.py`). docs/kernels.md describes the kernel and the measurements behind its structure."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .layout import Halves, columns, f16_sat, narrow_operand, token_order, tokens_from_planes

NEG = -1e30          # masked logit; every processed chunk holds at least one valid position
LOG2E = 1.4426950408889634


def masked_load(ref, **kw):
    """A masked load (`jax.experimental.pallas.triton.load`; also runs interpreted)."""
    from jax.experimental.pallas import triton as plgpu
    return plgpu.load(ref, **kw)


def decode_kernel(*refs, plan, names, static_names, has_hp, has_sid, block_size, tail_len, tiles_per_block,
                  num_splits, sm_scale, window, tokens_major, parts, steps, hp_chunk, ids_ahead, ids_group, gp,
                  q_rows, written, normalize, sink_len=0, hp_int8=False, new_token=False):
    """One program: sequence `program_id(0)`, kv head `program_id(1)`, split `program_id(2)`.

    refs: the query (its group's rows padded to Gp, or the sequence's [Hq, D] when `q_rows` says how
    many rows are the group's), the query's key channel planes for per-token int keys (plan.pk > 1),
    block tables, lengths, sequence ids (`has_sid`), the page fields in `names` order, the static
    parameters, the sink and tail (`has_hp`) and with `hp_int8` their scales and zero points (sink
    k, sink v, tail k, tail v; scale then zero each); then the outputs: the final output
    (`normalize`), or the partial output, max and sum of this split. sink_len: tokens of the sink
    buffer; shorter than a block, the rest of the first block is read from its page. new_token: the
    query's token is not cached yet (`paged_decode_attention(new_kv=...)`, merged by the caller): it
    sits at position `length`, so its own block - read from the ring, not a page - is `length // bs`.
    """
    d, vp, t_tok = plan.d, plan.vp, plan.t
    # tokens_major: scores [T, Gp] and accumulator [D/vp, Gp] (the matrix unit's N is the head
    # axis, 8 wide); otherwise scores [Gp, T] and accumulator [Gp, D/vp] (M = heads, 16 wide)
    ax = 0 if tokens_major else 1                                          # the token axis
    per_head = (lambda v: v[None, :]) if tokens_major else (lambda v: v[:, None])
    per_token = (lambda v: v[:, None]) if tokens_major else (lambda v: v[None, :])
    it = iter(refs)
    q_ref = next(it)
    qp_ref = next(it) if plan.pk > 1 else None
    bt_ref, len_ref = next(it), next(it)
    sid_ref = next(it) if has_sid else None  # None: sequence b's sink and tail are row b
    pages = {side: {n: next(it) for n in names[side]} for side in ("k", "v")}
    static = {side: {n: next(it) for n in static_names[side]} for side in ("k", "v")}
    if has_hp:
        sink_k, sink_v, tail_k, tail_v = next(it), next(it), next(it), next(it)
        hp_meta = [(next(it), next(it)) for _ in range(4)] if hp_int8 else [None] * 4
    o_ref = next(it)
    m_ref, l_ref = (None, None) if normalize else (next(it), next(it))

    b, split = pl.program_id(0), pl.program_id(2)
    bs, tpb = block_size, tiles_per_block
    # Block-table columns, block ids and sequence ids are clamped into range: with the entry's value
    # checks off, or under jit, bad indices must not address memory outside the table or the cache
    # (a few integer instructions per tile). The length itself is not, for speed (docs/kernels.md):
    # a length past the table's capacity re-reads its last block, or with the block ids read ahead
    # page 0; the output of such a row is wrong either way.
    length = len_ref[b]
    n_pages = pages["k"][names["k"][0]].shape[0]
    page_of = lambda j: jnp.clip(bt_ref[b, jnp.minimum(j, bt_ref.shape[1] - 1)], 0, n_pages - 1)  # noqa: E731
    ws = jnp.maximum(length - window, 0) if window is not None else jnp.int32(0)
    # base-2 softmax: sm_scale * log2(e) folded into the query once, exp2 below
    if q_rows is None:  # q_ref: this kv head's group, padded to Gp outside
        q = q_ref[...]
    else:  # q_ref: the sequence's [Hq, D]; the group's q_rows rows, zeros to Gp (no padding pass outside)
        rows = lax.broadcasted_iota(jnp.int32, (gp, d), 0)
        q = masked_load(q_ref.at[pl.ds(pl.program_id(1) * q_rows, gp), :], mask=rows < q_rows,
                         other=jnp.zeros((), q_ref.dtype))
    q = q.astype(jnp.float32) * (sm_scale * LOG2E)                            # [Gp, D]
    q_planes = [qp_ref[n] * (sm_scale * LOG2E) for n in range(plan.pk)] if qp_ref is not None else [q]
    if plan.cfg.method == "int":
        # per-token keys add z[t]·Σ_d q to the codes' product with the fp16 query: sum that same
        # fp16 query. Codes sit near their token's zero point, so a sum of the unrounded query is
        # off by an error amplified by code / (code - zero point): int8 keys with outlier channels
        # were 4e-3 of the output's maximum off the reference instead of 4e-4. Rounded once here,
        # not per tile (int4 heads-major: 751 -> 722 loop instructions offline).
        q, q_planes = f16_sat(q).astype(jnp.float32), [f16_sat(x).astype(jnp.float32) for x in q_planes]
    # narrow="bound": what the products' operands need of the query, once per program (`LayoutPlan.scaled`)
    q_bound = plan.program_bound(q)
    # the query (and its planes) as product operands, narrowed once per program for a wide cache
    # rather than by each tile's products
    q_op, qp_ops = (narrow_operand(q), [narrow_operand(x) for x in q_planes]) if plan.wide else (q, q_planes)
    # static int parameters [D/planes, planes] -> one [D/planes] vector per plane (Triton cannot
    # slice a loaded block: `layout.columns`); fp8's [1] scale as it is
    st = {side: {n: (columns(r[...].astype(jnp.float32)) if plan.cfg.method == "int" else r[...])
                 for n, r in static[side].items()} for side in ("k", "v")}

    # a sink shorter than a block: its positions are read from the sink only (not from block 0's page
    # nor, while block 0 is the query's, from the ring)
    partial_sink = has_hp and sink_len < bs
    ws_rest = jnp.maximum(ws, sink_len) if partial_sink else ws

    def update(carry, ss, poss, value_fn, masked=True, lo=None):
        """Online softmax (base 2) over score blocks `ss` (positions `poss`), then acc += value_fn(probabilities).
        masked=False: every position is valid (full quantized tiles without a window). Positions below
        `lo` (default: the window's start) are masked."""
        m, l, acc = carry
        if masked:
            lo = ws if lo is None else lo
            ss = [jnp.where(per_token((pos >= lo) & (pos < length)), s, NEG) for s, pos in zip(ss, poss)]
        m_new = m
        for s in ss:
            m_new = jnp.maximum(m_new, jnp.max(s, axis=ax))
        alpha = jnp.exp2(m - m_new)
        # masked logits give exactly 0: m_new is finite, every processed chunk holding a valid position
        ps = [jnp.exp2(s - per_head(m_new)) for s in ss]
        l_new = alpha * l
        for p in ps:
            l_new = l_new + jnp.sum(p, axis=ax)
        contrib = value_fn(ps)
        return m_new, l_new, tuple(per_head(alpha) * a + c for a, c in zip(acc, contrib))

    # ---- quantized tiles (for passthrough: every tile)
    # blocks read from pages: full, not a whole-block sink, and not the query's own block (position
    # length - 1, or length for a token not cached yet)
    n_full = (length if new_token else jnp.maximum(length - 1, 0)) // bs if has_hp else length // bs
    if has_hp:
        t_begin, t_end = (0 if partial_sink else tpb), n_full * tpb
    else:
        t_begin, t_end = 0, pl.cdiv(length, t_tok)
    t_begin = jnp.maximum(t_begin, ws_rest // t_tok)
    n_tiles = jnp.maximum(t_end - t_begin, 0)
    chunk = pl.cdiv(n_tiles, num_splits)
    lo = t_begin + split * chunk
    hi = jnp.minimum(lo + chunk, t_end)

    tok = jnp.arange(t_tok, dtype=jnp.int32)
    # quantized tiles are whole blocks before the query's own: all valid unless a window cuts one or
    # a short sink covers the first (passthrough caches also read the partial last tile from their pages)
    tiles_partial = window is not None or not has_hp or partial_sink

    # What a tile needs that no matrix product waits on - the key zero points (their fp32 sum
    # with the query, `LayoutPlan.tile_query`) and KVarN's value channel scales (they multiply the
    # value products' results) - Triton does not pipeline, so the tile would wait on plain loads.
    # They are loaded one tile ahead instead, through the loop carry (`tile_ahead`).
    ahead = tokens_major and steps == 1 and plan.tiled
    # With the tiles' copies double-buffered (ids_ahead, below) KVarN's key token scales come one
    # tile ahead too: their two copy buffers would keep a one-warp program's shared memory above
    # what lets 8 programs share an SM. With a single buffer (2 stages) carrying them was slower.
    tok_ahead = ahead and ids_ahead and plan.cfg.method == "kvarn" and not plan.k_whole and parts == 1
    if tokens_major and not plan.tiled:  # per-token scheme: its query side, once
        qside_pt = plan.chunk_query(q_planes)

    def tile_ahead(t, valid):
        """(key zero points [D], KVarN: value channel scales [D/vp, vp] and with `tok_ahead` key
        token scales [T/kc, kc]) of tile t; page 0's where `valid` is false (no read through a
        block-table entry that no tile of this program uses)."""
        tv = jnp.where(valid, t, 0)
        blk, sub = jnp.where(valid, page_of(tv // tpb), 0), tv % tpb
        if tok_ahead:
            return (pages["k"]["zero_chan"][blk, sub], pages["v"]["scale_chan"][blk, sub],
                    pages["k"]["scale_tok"][blk, sub])
        if plan.cfg.method == "kvarn":
            return pages["k"]["zero_chan"][blk, sub], pages["v"]["scale_chan"][blk, sub]
        return (pages["k"]["zero"][blk, sub],)

    def tile_body(i, carry, page_of=page_of):
        t, step = (i // steps, i % steps) if steps > 1 else (i, 0)
        blk = page_of(t // tpb)
        sub = t % tpb
        if tokens_major and not plan.tiled:
            return update(carry, [plan.chunk_scores(qside_pt, pages, blk, sub)], [t * t_tok + tok],
                          lambda ps: plan.chunk_values(ps[0], pages, blk, sub), masked=tiles_partial, lo=ws_rest)
        if tokens_major:  # softmax per token class; only the probabilities are put in token order
            z, chan, tsc = None, None, None
            if ahead:
                carry, here = carry[:3], carry[3:]
                z, chan = here[0], (here[1] if len(here) > 1 else None)
                tsc = here[2] if tok_ahead else None
                next_tile = tile_ahead(jnp.minimum(t + 1, hi - 1), t + 1 < hi)
            qside = plan.tile_query(q, pages, blk, sub, z, q_bound)
            n_parts = steps * parts
            for k in range(parts):  # parts of a step one after the other: fewer live registers
                part = step * parts + k
                ss = plan.tile_scores(qside, pages, blk, sub, part, n_parts, tok_scales=tsc)
                nc, n_tok = len(ss), t_tok // n_parts
                poss = [t * t_tok + part * n_tok + jnp.arange(n_tok // nc, dtype=jnp.int32) * nc + j
                        for j in range(nc)]
                vfn = lambda ps, part=part: plan.tile_values(ps[0] if len(ps) == 1 else tokens_from_planes(ps),
                                                          pages, blk, sub, part, n_parts, chan_tile=chan)
                carry = update(carry, ss, poss, vfn, masked=tiles_partial, lo=ws_rest)
            return carry + next_tile if ahead else carry
        ss = [token_order(plan.scores_heads_major(q, q_planes, pages, st, blk, sub, q_bound, (q_op, qp_ops)), gp)]
        poss = [t * t_tok + tok]
        return update(carry, ss, poss, lambda ps: plan.values_heads_major(ps, pages, st, blk, sub), masked=tiles_partial, lo=ws_rest)

    acc_shape = (d // vp, gp) if tokens_major else (gp, d // vp)
    carry = (jnp.full((gp,), NEG, jnp.float32), jnp.zeros((gp,), jnp.float32),
             tuple(jnp.zeros(acc_shape, jnp.float32) for _ in range(vp)))
    if ahead:
        carry = carry + tile_ahead(lo, lo < hi)
    if not ids_ahead:
        carry = lax.fori_loop(lo * steps, jnp.maximum(lo, hi) * steps, tile_body, carry)
    else:
        # The tiles' block ids read ahead, up to `ids` entries at a time, and taken from registers
        # in the loop: with no load of the table inside the tile loop, Triton's pipeliner (num_stages
        # >= 3) double-buffers the tiles' copies, so a tile's codes are in flight while the one
        # before it computes. With the table read in the loop it keeps a single buffer, filled at
        # the end of each iteration and waited on at the start of the next. (tile_ahead still reads
        # the table: its loads are plain ones a tile ahead, and no copy's address depends on them.)
        mbt = bt_ref.shape[1]
        cmax = pl.cdiv(mbt * tpb, num_splits)                      # tiles of a program, at most
        span = (cmax + tpb - 2) // tpb + 1                           # blocks they touch, at most
        ids = min(1 << (span - 1).bit_length(), ids_group, 1 << (mbt.bit_length() - 1))
        iota = jnp.arange(ids, dtype=jnp.int32)
        b_first = lo // tpb
        n_groups = jnp.where(hi > lo, pl.cdiv((jnp.maximum(hi, 1) - 1) // tpb - b_first + 1, ids), 0)

        def group(g, carry):
            gb = b_first + g * ids
            start = jnp.clip(gb, 0, mbt - ids)          # the load stays in the row; j - start indexes it
            row = bt_ref[b, pl.ds(start, ids)]
            page_in = lambda j: jnp.clip(jnp.sum(jnp.where(iota == j - start, row, 0)), 0, n_pages - 1)  # noqa: E731
            t_lo, t_hi = jnp.maximum(lo, gb * tpb), jnp.minimum(hi, (gb + ids) * tpb)
            return lax.fori_loop(t_lo * steps, jnp.maximum(t_lo, t_hi) * steps,
                                 functools.partial(tile_body, page_of=page_in), carry)
        carry = lax.fori_loop(0, n_groups, group, carry)
    carry = carry[:3]

    # ---- high-precision sink and partial tail: chunk c of the sink goes to split S-1-(c mod S), of
    # the tail to split c mod S. Tiles fill the splits from split 0 and the last has the fewest; on
    # split 0 alone the sink and tail made that program read several times what each other split
    # read at 2K tokens, and it set the call's time.
    if has_hp:
        sid = jnp.clip(sid_ref[b] if has_sid else b, 0, sink_k.shape[0] - 1)

        # bf16 rows enter the products as they are, against the query and probabilities in two bf16
        # halves each (`layout.Halves`): no per-chunk maximum to bring them into fp16
        halves = not hp_int8 and sink_k.dtype == jnp.bfloat16
        q_hp = Halves(q) if halves else q_op

        def rows_of(ref, meta, rows, plane=None):
            """Values of rows `rows` of the sequence's buffer ([hc, D], or value plane `plane`
            [hc, D/vp]): bf16 storage with `halves` as it is, other float storage in fp32, int8
            codes times their token's scale plus its zero."""
            x = ref[sid, rows] if plane is None else ref[sid, rows, :, plane]
            if halves:
                return x
            x = x.astype(jnp.float32)
            if meta is None:
                return x
            return x * meta[0][sid, rows].astype(jnp.float32)[:, None] + meta[1][sid, rows].astype(jnp.float32)[:, None]

        def hp_loop(carry, k_ref, v_ref, metas, base, start_pos, count, hc, lo, owner):
            """This split's chunks of `hc` tokens from rows [base, base + count) of the sequence's
            buffer - chunk c where c = owner (mod num_splits); positions below `lo` masked."""
            c_lo = jnp.maximum(lo - start_pos, 0) // hc
            c_hi = pl.cdiv(count, hc)
            c0 = c_lo + (owner + num_splits - c_lo % num_splits) % num_splits   # the first chunk >= c_lo it owns
            k_meta, v_meta = metas

            def body(i, carry):
                c = c0 + i * num_splits
                rows = pl.ds(pl.multiple_of(base + c * hc, hc), hc)
                kk = rows_of(k_ref, k_meta, rows)                            # [hc, D]
                pos = start_pos + c * hc + jnp.arange(hc, dtype=jnp.int32)
                def vals(ps):  # the probabilities as an operand once, for every value plane
                    p = Halves(ps[0]) if halves else plan.probs(ps[0])
                    if tokens_major:
                        return [plan.dot_tn(rows_of(v_ref, v_meta, rows, n), p, min_n=8) for n in range(vp)]
                    return [plan.dot(p, rows_of(v_ref, v_meta, rows, n)) for n in range(vp)]
                scores = plan.dot_t(kk, q_hp, min_n=8) if tokens_major else plan.dot_t(q_hp, kk)
                return update(carry, [scores], [pos], vals, lo=lo)
            return lax.fori_loop(0, jnp.maximum(pl.cdiv(c_hi - c0, num_splits), 0), body, carry)

        hc = min(hp_chunk, bs)
        carry = hp_loop(carry, sink_k, sink_v, hp_meta[0:2], 0, 0, jnp.minimum(length, sink_len),
                        min(hc, sink_len), ws, num_splits - 1 - split)
        # the ring holds the query's block; a whole-block sink holds block 0 instead
        tail_count = length - n_full * bs if partial_sink else jnp.where(n_full >= 1, length - n_full * bs, 0)
        carry = hp_loop(carry, tail_k, tail_v, hp_meta[2:4], (n_full * bs) % tail_len, n_full * bs, tail_count,
                        hc, ws_rest, split)

    m, l, acc = carry
    # only the first `written` entries of the Gp axis (the group's heads, up to a power of two) are
    # stored: the padding's partial outputs would double what the merge reads for a GQA group of 4
    keep = (lambda x, axis: x) if written == gp else (lambda x, axis: jnp.split(x, gp // written, axis=axis)[0])  # noqa: E731
    if normalize:
        # one split: this program's output is final - normalized here and stored with the value
        # planes' channels in order (o_ref [heads, D/vp, vp], plane n at [..., n]), so no merge
        # kernel runs after this one
        den = jnp.where(l > 0, l, 1.0)   # no valid position (length 0): the output is 0, as merged
        for n in range(vp):
            o = keep(acc[n] / per_head(den), 1 if tokens_major else 0)
            o_ref[:, :, n] = o.T if tokens_major else o
        return
    for n in range(vp):
        o_ref[n] = keep(acc[n], 1 if tokens_major else 0)
    m_ref[...] = keep(m, 0)
    l_ref[...] = keep(l, 0)
