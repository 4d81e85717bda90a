"""Accuracy and capacity tools: what a KV-cache scheme costs in quality and buys in memory.

    serving_attention   teacher-forced attention that sees the cache as serving stores it
    perplexity          perplexity, KL to the unquantized model, top-1 agreement (`kvarn-jax eval`)
    agreement           greedy continuations vs an fp16 cache (first divergence, identical tokens)
    errors              per-layer, per-head K/V/attention error and outlier key channels (`report-errors`)
    capacity            tokens and batch that fit in accelerator memory (`capacity`)
    tune, layer_config  per-layer scheme choice under a bit budget and its file format (`tune`)
    plots, cli          figures and the subcommands (`cli.register(subparsers)`, `cli.main(argv)`)
    arguments           the help formatter, flag types and early checks every `kvarn-jax` command uses

They measure against the PyTorch (transformers) model in fp32 and need the `models` extra (torch,
transformers); plots need matplotlib. Nothing here is imported by `import kvarn_jax`.
"""
