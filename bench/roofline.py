"""The roofline of a bench run: this machine's matmul peak and the transformer's achieved GFLOPS.

One implementation for ``bench/bench_pipeline.py`` and ``bench/full_size.py``:

* :func:`matmul_peak_gflops`: best-of-``repeats`` GFLOPS of a square ``size`` x ``size`` matmul in a
  dtype (2 * size**3 FLOPs), with the thread count the run uses (``torch.get_num_threads()``):
  the attainable peak the transformer's matmuls are held against.
* :func:`step_flops` / :func:`conditioning_flops`: the transformer's matmul FLOPs counted from its
  config and token counts (below), checked against ``torch.utils.flop_counter`` in
  tests/test_bench_measures.py.
* :class:`TransformerMeter`: hooks on a transformer that add up each forward's FLOPs and seconds.
* :func:`roofline`: the four pinned JSON keys.

FLOPs counted (a multiply-add is 2 FLOPs; elementwise work, norms, RoPE and softmax are not
counted: they are memory-bound and small next to the matmuls). With D = heads * head_dim, Dkv =
kv_heads * head_dim, F = intermediate_size, S = L + N tokens (text + image), B batch rows (CFG's
two branches are two rows or two calls), a linear layer of K inputs and M outputs over T tokens is
2 * T * K * M, attention's QK^T and AV are 2 * S^2 * D each (every head, GQA or not):

    block  = 2 * S * (3 * D^2 + 2 * D * Dkv + 3 * D * F) + 4 * S^2 * D
             (q, gate, out: D x D; k, v: D x Dkv; SwiGLU gate, up, down: D x F)
    step   = B * (num_layers * block + 2 * N * 64 * D [img_in] + 2 * N * D * 64 [final]
                  + 2 * (E * D + D^2) [time_embed] + 2 * D * 6 * D [time_mod_proj])

``step`` is one ``forward`` with a prepared ``conditioning`` (the pipeline's denoising step);
:func:`conditioning_flops` is ``prepare_conditioning``'s text fusion (per-token layer stacks of
length num_text_layers, then the refiner over L) and text projection, run once per generation.
"""

from __future__ import annotations

import time

PINNED_KEYS = ("peak_gflops_fp32", "peak_gflops_bf16", "achieved_gflops", "fraction_of_peak")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_gflops(dtype, device="cpu", size: int | None = None, repeats: int = 5) -> float:
    """Best-of-``repeats`` GFLOPS of ``(size, size) @ (size, size)`` in ``dtype`` (a torch dtype)
    on ``device`` (default size: 2048 on CPU, ~0.1-1 s a product on two cores; 8192 on a GPU),
    after one warm-up."""
    import torch

    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 2048)
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(size, size, generator=generator, device=device).to(dtype)
    b = torch.randn(size, size, generator=generator, device=device).to(dtype)
    out = torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def machine_peaks(device="cpu", size: int | None = None) -> dict[str, float]:
    """``{"peak_gflops_fp32": ..., "peak_gflops_bf16": ...}`` measured now, with this process's
    threads (``size``: :func:`matmul_peak_gflops`'s)."""
    import torch

    return {"peak_gflops_fp32": matmul_peak_gflops(torch.float32, device, size),
            "peak_gflops_bf16": matmul_peak_gflops(torch.bfloat16, device, size)}


def _attention_block_flops(tokens: int, seq: int, dim: int, kv_dim: int, hidden: int) -> int:
    """Matmul FLOPs of one attention + SwiGLU block over ``tokens`` rows in sequences of ``seq``."""
    linear = 2 * tokens * (3 * dim * dim + 2 * dim * kv_dim + 3 * dim * hidden)
    return linear + 4 * tokens * seq * dim


def step_flops(config, image_tokens: int, text_tokens: int, batch: int = 1) -> int:
    """Matmul FLOPs of one ``forward`` with a prepared conditioning: ``batch`` rows of
    ``text_tokens`` + ``image_tokens`` (see the module docstring for the formula)."""
    dim = config["attention_head_dim"] * config["num_attention_heads"]
    kv_dim = config["attention_head_dim"] * config["num_key_value_heads"]
    seq = text_tokens + image_tokens
    blocks = config["num_layers"] * _attention_block_flops(seq, seq, dim, kv_dim, config["intermediate_size"])
    io = 2 * image_tokens * config["in_channels"] * dim * 2  # img_in and the final layer
    time_embedding = 2 * (config["timestep_embed_dim"] * dim + dim * dim) + 2 * dim * 6 * dim
    return batch * (blocks + io + time_embedding)


def conditioning_flops(config, text_tokens: int, batch: int = 1) -> int:
    """Matmul FLOPs of ``prepare_conditioning`` without padding: the layer-wise text blocks (each of
    the ``text_tokens`` tokens' stack of num_text_layers states is a sequence), the projector over the
    layer axis, the refiner blocks over the text, and the text projection to the model width."""
    text_dim, layers = config["text_hidden_dim"], config["num_text_layers"]
    text_kv = text_dim // config["text_num_attention_heads"] * config["text_num_key_value_heads"]
    hidden = config["text_intermediate_size"]
    dim = config["attention_head_dim"] * config["num_attention_heads"]
    layerwise = config["num_layerwise_text_blocks"] * _attention_block_flops(
        text_tokens * layers, layers, text_dim, text_kv, hidden)
    projector = 2 * text_tokens * text_dim * layers
    refiner = config["num_refiner_text_blocks"] * _attention_block_flops(text_tokens, text_tokens, text_dim, text_kv, hidden)
    projection = 2 * text_tokens * (text_dim * dim + dim * dim)
    return batch * (layerwise + projector + refiner + projection)


class TransformerMeter:
    """Adds up the matmul FLOPs (:func:`step_flops`, from each call's shapes) and the wall seconds of
    every ``forward`` of ``transformer`` made with a prepared ``conditioning`` (the denoising steps).

        with TransformerMeter(pipe.transformer) as meter:
            pipe(...)
        meter.flops, meter.seconds, meter.calls
        meter.usages  # each such call's krea2_diffusers.cpu_usage.Usage (wall, CPU, page faults)
    """

    def __init__(self, transformer):
        self.transformer, self.flops, self.seconds, self.calls = transformer, 0, 0.0, 0
        self.handles: list = []
        self.started: float | None = None
        self.usages: list = []
        self.usage_before = None

    def reset(self) -> None:
        self.flops, self.seconds, self.calls, self.usages = 0, 0.0, 0, []

    def before(self, module, args, kwargs) -> None:
        from krea2_diffusers.cpu_usage import Usage

        _sync(next(module.parameters()).device)  # work queued before the call is not the call's
        self.started = time.perf_counter()
        self.usage_before = Usage.now()

    def after(self, module, args, kwargs, output) -> None:
        conditioning = kwargs.get("conditioning")
        hidden = args[0] if args else kwargs["hidden_states"]
        _sync(hidden.device)
        if conditioning is None:  # a one-call forward (training): not a denoising step
            return
        from krea2_diffusers.cpu_usage import Usage

        self.usages.append(Usage.now() - self.usage_before)
        self.seconds += time.perf_counter() - self.started
        self.flops += step_flops(self.transformer.config, hidden.shape[1], conditioning.text_len, hidden.shape[0])
        self.calls += 1

    def __enter__(self):
        self.handles = [self.transformer.register_forward_pre_hook(self.before, with_kwargs=True),
                        self.transformer.register_forward_hook(self.after, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def dtype_name(dtype) -> str:
    """"float32" for ``torch.float32`` or "float32"."""
    return str(dtype).removeprefix("torch.")


def roofline(flops: int, seconds: float, dtype, peaks: dict[str, float]) -> dict[str, float]:
    """The four pinned keys: both peaks, ``flops / seconds`` in GFLOPS, and that as a fraction of the
    peak of ``dtype`` (torch dtype or its name: the dtype the transformer's matmuls ran in; float16
    counts as bf16's)."""
    achieved = flops / seconds / 1e9 if seconds > 0 else 0.0
    peak = peaks["peak_gflops_fp32"] if dtype_name(dtype) == "float32" else peaks["peak_gflops_bf16"]
    return {"peak_gflops_fp32": peaks["peak_gflops_fp32"], "peak_gflops_bf16": peaks["peak_gflops_bf16"],
            "achieved_gflops": achieved, "fraction_of_peak": achieved / peak}


def describe(result: dict[str, float], dtype) -> str:
    """One line for the console."""
    return (f"transformer {result['achieved_gflops']:.1f} GFLOPS = {100 * result['fraction_of_peak']:.1f}% of the "
            f"{dtype_name(dtype)} matmul peak (peaks: fp32 {result['peak_gflops_fp32']:.1f}, "
            f"bf16 {result['peak_gflops_bf16']:.1f} GFLOPS)")


def main(argv=None) -> None:
    """The transformer alone against the peak: one denoising forward (conditioning prepared) of a
    proportioned model (``--width`` = 128-wide heads x n, FFN 8/3 x width) at ``--tokens`` image
    tokens plus ``--text`` text tokens, best of ``--repeats``.

        python bench/roofline.py [--width 1024] [--layers 4] [--tokens 1024] [--text 32] [--dtype bfloat16]
    """
    import argparse
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from krea2_diffusers import Krea2Transformer2DModel
    from krea2_diffusers.models.layers import RMSNorm
    from krea2_diffusers.models.tiny import proportioned_transformer_config

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--text", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    config = proportioned_transformer_config(num_layers=args.layers, heads=args.width // 128, head_dim=128)
    model = Krea2Transformer2DModel(**config).eval()
    for module in model.modules():  # as loaded with torch_dtype: norm scales stay float32
        if not isinstance(module, RMSNorm):
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)
    g = torch.Generator().manual_seed(0)
    encoder = torch.randn(args.batch, args.text, config["num_text_layers"], config["text_hidden_dim"], generator=g)
    latents = torch.randn(args.batch, args.tokens, config["in_channels"], generator=g, dtype=dtype)
    timestep = torch.full((args.batch,), 0.5)
    with torch.inference_mode(), TransformerMeter(model) as meter:
        conditioning = model.prepare_conditioning(encoder.to(dtype), torch.zeros(args.text + args.tokens, 3))
        model(latents, timestep=timestep, conditioning=conditioning)  # warm-up
        best, peaks = float("inf"), {}
        for _ in range(args.repeats):  # peaks and forwards taken in turns: a shared machine's load hits both alike
            peaks = {k: max(v, peaks.get(k, 0.0)) for k, v in machine_peaks().items()}
            meter.reset()
            model(latents, timestep=timestep, conditioning=conditioning)
            best = min(best, meter.seconds)
    result = roofline(meter.flops, best, dtype, peaks)
    print(f"width {args.width}, {args.layers} layers, {args.tokens} + {args.text} tokens, batch {args.batch}, "
          f"{args.dtype}, {torch.get_num_threads()} threads: {meter.flops / 1e9:.1f} GFLOP in {best:.3f} s")
    print(describe(result, dtype))


if __name__ == "__main__":
    main()
