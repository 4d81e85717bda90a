"""vLLM's own CPU attention op computing the plugin's prefill rule in one call, on synthetic data
(issue 32; the plugin does this since `torch_ops._prefill_rule`, before with two torch
flash-attention calls and a merge by log-sum-exp).

    python benchmarks/tools/vllm_cpu_attention_rule.py [--tokens 4000] [--dtype float32]

The rule: a query in block j attends to blocks 0..j-1 as stored (quantized, here their dequantized
values) and to its own block's high-precision rows up to itself. Each block of queries is its own
request for `ops.cpu_attention_with_kv_cache`, with the block table
[dequantized blocks 0..j-1, high-precision block j] and causal masking, over one staged cache
written through `ops.cpu_attn_reshape_and_cache` (the op's own layout for the CPU's ISA). The
output is compared with a masked dense attention of the rule on a few query blocks, and the call is
timed against one causal torch flash call over the same keys (SmolLM2's heads, one thread).
With bfloat16 on a CPU with AMX tiles the script asks the kernel for them first, as vLLM's CPU
worker does (without it the op stops with an illegal instruction).
"""

import argparse
import math
import time

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head_dim (default: SmolLM2's)")
    p.add_argument("--block-size", type=int, default=128)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    n, bs, dt = a.tokens, a.block_size, getattr(torch, a.dtype)
    hq, hk, d = (int(x) for x in a.heads.split(","))
    nblk = -(-n // bs)
    isa = _get_attn_isa(dt, bs, d)
    if isa == "amx":
        torch._C._cpu._init_amx()
    q = torch.randn(n, hq, d, dtype=dt)
    deq = [torch.randn(nblk, hk, bs, d, dtype=dt) for _ in range(2)]   # block b as the pages hold it
    hp = [torch.randn(nblk, hk, bs, d, dtype=dt) for _ in range(2)]    # block b's high-precision rows
    kc, vc = (torch.zeros(2 * nblk, hk, bs, d, dtype=dt) for _ in range(2))
    for (k, v), base in ((deq, 0), (hp, nblk)):  # staged in the op's layout: [dequantized | high precision]
        kk, vv = (x.permute(0, 2, 1, 3).reshape(-1, hk, d).contiguous() for x in (k, v))
        ops.cpu_attn_reshape_and_cache(kk, vv, kc, vc, torch.arange(base * bs, base * bs + kk.shape[0]), isa)
    starts = torch.tensor([min(j * bs, n) for j in range(nblk + 1)], dtype=torch.int32)
    lens = torch.tensor([min((j + 1) * bs, n) for j in range(nblk)], dtype=torch.int32)
    table = torch.zeros(nblk, nblk, dtype=torch.int32)
    for j in range(nblk):
        table[j, :j] = torch.arange(j, dtype=torch.int32)
        table[j, j] = nblk + j
    scale = 1 / math.sqrt(d)

    def rule():
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=nblk, num_heads=hq, num_kv_heads=hk, head_dim=d, seq_lens=lens, dtype=dt,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=starts,
                                        seq_lens=lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1,
                                        block_table=table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
        return out

    out = rule()
    err = 0.0
    for j in sorted({0, 1, nblk // 2, nblk - 1}):
        lo, hi = j * bs, min((j + 1) * bs, n)
        k, v = (torch.cat([x[:j].permute(1, 0, 2, 3).reshape(hk, -1, d), y[j][:, :hi - lo]], 1).float()
                .repeat_interleave(hq // hk, 0) for x, y in zip(deq, hp))
        s = q[lo:hi].float().transpose(0, 1) @ k.transpose(1, 2) * scale
        s = s.masked_fill(torch.arange(k.shape[1])[None, None, :] > (lo + torch.arange(hi - lo))[None, :, None],
                          -math.inf)
        ref = (s.softmax(-1) @ v).transpose(0, 1)
        err = max(err, float((out[lo:hi].float() - ref).abs().max() / ref.abs().max()))
    for _ in range(2):
        rule()
    t0 = time.perf_counter()
    for _ in range(5):
        rule()
    t_rule = (time.perf_counter() - t0) / 5
    kf, vf = (x.permute(1, 0, 2, 3).reshape(1, hk, -1, d)[:, :, :n].repeat_interleave(hq // hk, 1) for x in deq)
    qf = q.transpose(0, 1)[None]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash(qf, kf, vf, 0.0, True, scale=scale)
    t0 = time.perf_counter()
    for _ in range(5):
        flash(qf, kf, vf, 0.0, True, scale=scale)
    t_flash = (time.perf_counter() - t0) / 5
    print(f"isa {isa}, {a.dtype}, {n} tokens: the rule in one vLLM call {t_rule * 1e3:.1f} ms, max relative error "
          f"{err:.1e} against the masked reference; one causal torch flash call over the same keys {t_flash * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
