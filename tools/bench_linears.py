"""``python -m ringstream.tools.bench_linears``: the linears of a model's layers against the host's limits.

For a Llama-shaped layer (the engine's packed groups: q / k / v as one GEMM, ``o_proj``, gate / up as one,
``down_proj``), ``--layers`` copies of random weights, so that every pass streams them from memory as an engine
step does (cold in cache), it times at each row count of ``--rows``:

* the engine's packed linears (:class:`ringstream.daemon.engine.linear.LinearKernel`, native where the kernels
  are built, else oneDNN), as GFLOPS (2 x rows x weights per second) and as GB/s of weights read;
* PyTorch's ``F.linear`` on the same weights;
* a plain sum over as many bytes as the weights hold, the host's read bandwidth in the same process.

At few rows (decode) a linear is bound by the weights' reads (compare GB/s with the plain sum); at many rows
(prefill) by the FMA units (GFLOPS). The medians of ``--repeats`` passes; one line a row count, and ``--json``.

Usage::

    python -m ringstream.tools.bench_linears [--hidden 768] [--intermediate 2048] [--heads 12] [--kv-heads 4]
        [--layers 12] [--rows 16,256] [--threads N] [--dtype float32|bfloat16] [--repeats 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def layer_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of one Llama layer's packed GEMMs: q / k / v, o, gate / up, down."""
    head_dim = hidden // heads
    return [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * intermediate, hidden),
            (hidden, intermediate)]


def _median_s(fn, repeats: int) -> float:
    fn()  # warm: code paths, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(shapes: list[tuple[int, int]], layers: int, rows: list[int], dtype: torch.dtype,
            repeats: int) -> dict:
    """The figures above for ``layers`` copies of ``shapes``; returns a dict (kernel name, weight bytes, one
    entry per row count). Raises ValueError for an empty shape list or a row count below 1."""
    from ringstream.daemon.engine.kernels import native_ops
    from ringstream.daemon.engine.linear import LinearKernel

    if not shapes or layers < 1 or any(m < 1 for m in rows):
        raise ValueError("need at least one shape, one layer and row counts >= 1")
    ops = native_ops()
    kernel = LinearKernel.native(ops) if ops is not None else LinearKernel.onednn()
    if dtype not in kernel.dtypes:
        kernel = None
    generator = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=generator, dtype=torch.float32).mul_(0.02).to(dtype)
                for n, k in shapes] for _ in range(layers)]
    packed = [[kernel.pack(w) for w in layer] for layer in weights] if kernel is not None else None
    weight_bytes = sum(n * k for n, k in shapes) * layers * weights[0][0].element_size()
    flat = torch.ones(weight_bytes // 4, dtype=torch.float32)
    read_gbs = weight_bytes / _median_s(flat.sum, repeats) / 1e9
    result = {"kernel": kernel.name if kernel is not None else None, "dtype": str(dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "weight_bytes": weight_bytes, "plain_read_gb_s": read_gbs,
              "rows": []}
    with torch.inference_mode():
        for m in rows:
            inputs = {k: torch.randn(m, k, generator=generator).to(dtype) for _, k in shapes}
            flops = 2 * m * weight_bytes / weights[0][0].element_size()
            entry = {"rows": m}

            def torch_pass():
                for layer in weights:
                    for w in layer:
                        F.linear(inputs[w.shape[1]], w)

            passes = {"torch": torch_pass}
            if kernel is not None:
                def packed_pass():
                    for layer, packs in zip(weights, packed):
                        for w, p in zip(layer, packs):
                            kernel.apply(inputs[w.shape[1]], p, None, w.shape[0])

                passes = {"packed": packed_pass, **passes}
            for name, fn in passes.items():
                seconds = _median_s(fn, repeats)
                entry[name] = {"ms": seconds * 1e3, "gflops": flops / seconds / 1e9,
                               "weights_gb_s": weight_bytes / seconds / 1e9}
            result["rows"].append(entry)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringstream.tools.bench_linears",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12, help="copies of the layer's weights (default 12)")
    parser.add_argument("--rows", default="16,256", help="comma list of row counts (default 16,256)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: a comma list of integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = layer_shapes(args.hidden, args.intermediate, args.heads, args.kv_heads)
    try:
        result = measure(shapes, args.layers, rows, getattr(torch, args.dtype), args.repeats)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"{args.layers} layers x {shapes} ({result['weight_bytes'] / 1e6:.1f} MB of {result['dtype']} weights), "
          f"{result['threads']} threads; plain read {result['plain_read_gb_s']:.1f} GB/s")
    for entry in result["rows"]:
        parts = [f"{name} {entry[name]['ms']:.2f} ms = {entry[name]['gflops']:.0f} GFLOPS, "
                 f"{entry[name]['weights_gb_s']:.1f} GB/s" for name in ("packed", "torch") if name in entry]
        print(f"{entry['rows']:>5} rows: " + "; ".join(parts))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
