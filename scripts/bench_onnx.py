"""onnxruntime vs PyTorch on the CPU: latency side by side for the model.onnx that `vitft export --onnx` writes.

The model (random weights) is exported with vitft's own export_onnx, which also verifies it (the max logit
difference is printed). Then, per batch size, runs alternate between PyTorch (eval, no_grad, fp32) and an
onnxruntime CPU session (default graph optimisations) so a busy machine hits both alike; each number is the
median over --steps timed runs after --warmup untimed ones. Both use --threads intra-op threads.

    python scripts/bench_onnx.py                                   # vit_tiny_patch16_224, batch 1 and 16
    python scripts/bench_onnx.py --model vit_small_patch16_224 --batch-sizes 1 8 32 --threads 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from vit_finetune import create_model
from vit_finetune.hub.onnx import INPUT_NAME, OUTPUT_NAME, export_onnx


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_tiny_patch16_224", help="architecture (random weights)")
    p.add_argument("--img-size", type=int, default=None, help="default: the architecture's")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=7, help="timed runs per engine and batch size")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads for both engines (default: torch's; 1 is steadier on a shared CPU)")
    return p.parse_args()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    import onnxruntime as ort

    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = create_model(args.model, num_classes=1000, img_size=args.img_size).eval()
    h, w = model.patch_embed.img_size
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        check = export_onnx(model, tmp)
        export_s = time.perf_counter() - start
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(check.path), options, providers=["CPUExecutionProvider"])
        print(f"{args.model} at {h}x{w}, fp32, {threads} threads ({os.cpu_count()} cores seen; "
              f"on a shared machine the numbers are noisy)")
        print(f"export + verification: {export_s:.1f} s; max |logit difference| onnxruntime vs PyTorch "
              f"{check.max_abs_diff:.2e} (batches {', '.join(map(str, check.batch_sizes))})")
        print(f"{'batch':>5} {'PyTorch ms':>11} {'onnxruntime ms':>15} {'ORT / PyTorch':>14} {'max diff':>9}")
        for batch in args.batch_sizes:
            x = torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(batch))
            feed = {INPUT_NAME: x.numpy()}

            def run_torch():
                with torch.no_grad():
                    return model(x)

            def run_ort():
                return session.run([OUTPUT_NAME], feed)[0]

            diff = float((torch.from_numpy(run_ort()) - run_torch()).abs().max())
            times = {"torch": [], "ort": []}
            for step in range(args.warmup + args.steps):
                order = (("torch", run_torch), ("ort", run_ort))
                for name, fn in order if step % 2 == 0 else order[::-1]:
                    elapsed = timed(fn)
                    if step >= args.warmup:
                        times[name].append(elapsed)
            pt, ox = (1000 * statistics.median(times[k]) for k in ("torch", "ort"))
            print(f"{batch:>5} {pt:>11.1f} {ox:>15.1f} {ox / pt:>14.2f} {diff:>9.1e}")


if __name__ == "__main__":
    main()
