"""``python -m tools.dev.codec_bench``: the measured cost of the compressed exchange's codec.

A compressed preset quantises every streamed K/V or halo chunk of a rank against its reference
(:func:`~patchray.distributed.sampling.comm_manager.encode_residual`, once per chunk) and adds every peer's decoded
residual to its copy of that peer's row (:func:`~patchray.distributed.sampling.comm_manager.apply_residual`, N - 1
times per chunk). Both run on the compute stream, so their time adds to a rank's step. This times the two functions
the runtime calls, on chunks of the size the exchange uses, with CUDA events (or the wall clock on CPU), and reports
milliseconds per GB of the stream's uncompressed bytes, for each codec of ``--codecs``: ``eager`` (op by op),
``compiled`` (the same functions through ``torch.compile``), ``triton`` (two hand-fused kernels).

The step model's codec cost is ``own_GB x (encode_ms_per_GB + (N - 1) x apply_ms_per_GB)``, where ``own_GB`` is
the rank's uncompressed streamed bytes per step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from patchray.distributed.sampling.comm_manager import CODECS, GROUP, apply_residual, encode_residual

__all__ = ["time_codec", "main"]


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return run


def time_codec(numel: int, bits: int, dtype: torch.dtype, device: torch.device, iters: int = 5, warmup: int = 2,
               codec: str = "eager") -> dict:
    """Median ms of one :func:`encode_residual` and one :func:`apply_residual` over a chunk of ``numel`` elements
    (a whole number of groups), on a reference and a fresh value that differ like two neighbouring steps' K/V."""
    numel = (numel // GROUP) * GROUP
    g = torch.Generator(device="cpu").manual_seed(0)
    ref = torch.randn(numel, generator=g).to(device=device, dtype=dtype)
    fresh = (ref.float() + 0.05 * torch.randn(numel, generator=g).to(device)).to(dtype)
    peer = ref.clone()
    def enc(f, r, b):
        return encode_residual(f, r, b, codec)

    def app(r, p, b):
        apply_residual(r, p, b, codec)

    run = _timer(device)
    payload = enc(fresh, ref.clone(), bits)
    t_enc, t_app = [], []
    for i in range(warmup + iters):
        r = ref.clone()
        te = run(lambda: enc(fresh, r, bits))
        p = peer.clone()
        ta = run(lambda: app(p, payload, bits))
        if i >= warmup:
            t_enc.append(te)
            t_app.append(ta)
    # the receiver's copy must equal the sender's reference bit for bit (error feedback)
    r, p = ref.clone(), ref.clone()
    out = enc(fresh, r, bits)
    app(p, out, bits)
    gb = numel * torch.empty((), dtype=dtype).element_size() / 1e9
    e, a = statistics.median(t_enc), statistics.median(t_app)
    return {"numel": numel, "bits": bits, "dtype": str(dtype).replace("torch.", ""), "codec": codec,
            "compiled": codec != "eager",
            "encode_ms": round(e, 4), "apply_ms": round(a, 4), "stream_gb": round(gb, 6),
            "encode_ms_per_gb": round(e / gb, 3), "apply_ms_per_gb": round(a / gb, 3),
            "payload_bytes": int(out.numel()), "receiver_equals_sender": bool(torch.equal(r, p)),
            "iters": iters}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--numel", type=int, nargs="+", default=[1 << 20, 1 << 24, 1 << 26],
                    help="chunk sizes in elements (a 60-slot chunk of FLUX.1's K/V at 1024x1024 and 2 ranks is ~1.4e8)")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2, 1])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--codecs", nargs="+", choices=list(CODECS), default=["eager"],
                    help="the codec implementations to time (triton and compiled need CUDA and Triton)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rows = []
    for numel in args.numel:
        for bits in args.bits:
            for kind in args.codecs:
                try:
                    r = time_codec(numel, bits, dtype, device, iters=args.iters, codec=kind)
                except Exception as e:  # noqa: BLE001 - a variant that cannot run is recorded, not fatal
                    r = {"numel": numel, "bits": bits, "codec": kind, "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(r)
                print(json.dumps(r), flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "measured": True, "method": __doc__.split("\n\n")[1], "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
