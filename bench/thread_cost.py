"""What a pass costs on the main thread against another Python thread of the same process.

The serving engine runs its passes on a thread of its own (`specd.serving`, ``specd-engine``).
This script times the same work on the main thread and on a second thread: one-row products, an
attention over 300 keys, the LM head, and a greedy SmolLM2 decode. The second thread runs twice:
beside the main thread's OpenMP pool (what the engine did before `specd.threads`), and after the
main thread released it (`release_pool`, what the engine does now). It also times the main thread
limited to one intra-op thread, for comparison. It prints a table and writes JSON.

    .venv/bin/python bench/thread_cost.py [--threads 2] [--json out/bench/thread_cost.json]

It needs the zoo's ``smollm2-135m`` (`specd zoo build --only smollm2-135m`). Run it alone: it
times passes on a machine whose cores it assumes are idle.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specd import zoo
from specd.engine import autoregressive
from specd.models.loading import load_model
from specd.sampling import SamplingParams
from specd.threads import release_pool


def _per_call(fn, calls: int) -> float:
    with torch.no_grad():
        for _ in range(5):
            fn()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
    return (time.perf_counter() - start) / calls


def _on_thread(fn):
    """``fn()`` on a fresh Python thread (what the serving engine's passes run on)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def measure(threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = load_model(zoo.ensure("smollm2-135m"))
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    x, w = torch.randn(1, hidden), torch.randn(model.config.intermediate_size, hidden)
    head = torch.randn(vocab, hidden)
    q, k, v = torch.randn(1, 9, 1, 64), torch.randn(1, 9, 300, 64), torch.randn(1, 9, 300, 64)
    prompt, decode_tokens = [[1, *range(100, 140)]], 48
    cases = {
        "one-row linear (hidden -> intermediate), us": (lambda: F.linear(x, w), 500, 1e6),
        "attention, 1 query over 300 keys, us": (lambda: F.scaled_dot_product_attention(q, k, v), 500, 1e6),
        "LM head, one row, ms": (lambda: F.linear(x, head), 50, 1e3),
        "SmolLM2 greedy decode, ms/token": (
            lambda: autoregressive(model, prompt, SamplingParams(max_tokens=decode_tokens)), 1, 1e3 / decode_tokens),
    }
    rows = []
    for name, (fn, calls, scale) in cases.items():
        main = _per_call(fn, calls) * scale
        other = _on_thread(lambda fn=fn, calls=calls: _per_call(fn, calls)) * scale
        release_pool()  # the main thread's pool goes; the next case's main timing starts a new one
        released = _on_thread(lambda fn=fn, calls=calls: _per_call(fn, calls)) * scale
        torch.set_num_threads(1)
        one = _per_call(fn, calls) * scale
        torch.set_num_threads(threads)
        rows.append({"case": name, "main_thread": main, "other_thread": other, "other_thread_released": released,
                     "main_one_thread": one, "other_over_main": other / main, "released_over_main": released / main})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--json", default="out/bench/thread_cost.json")
    args = parser.parse_args()
    rows = measure(args.threads)
    print(f"{'case':<46}{'main':>9}{'other thread':>14}{'released':>10}{'main, 1 thread':>16}"
          f"{'other/main':>12}{'released/main':>15}")
    for r in rows:
        print(f"{r['case']:<46}{r['main_thread']:>9.1f}{r['other_thread']:>14.1f}{r['other_thread_released']:>10.1f}"
              f"{r['main_one_thread']:>16.1f}{r['other_over_main']:>11.2f}x{r['released_over_main']:>14.2f}x")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
