"""Streaming Zipformer: cost per chunk, real-time factor and state size, against simulated streaming.

For each preset x policy x number of streams x chunk size, a causal encoder (random weights: speed does not depend
on them) encodes ``--seconds`` of audio per stream twice, interleaved run by run:

* streaming: chunk by chunk with caches (``ZipformerEncoder.streaming_forward``), as a live stream would;
* simulated: the whole utterance at once under the chunk mask (``forward(chunk_size=..., left_context_frames=...)``),
  the peer: the same outputs (tests/models/test_zipformer_streaming.py), computed offline.

The table gives the median per-chunk latency (and its 90th percentile) of streaming, both RTFx values (audio
seconds per wall second, all streams together; median of ``--runs``), the streaming/simulated time ratio, and the
streaming state per stream (every cache, in the policy's dtype).

    python benchmarks/streaming.py --sizes tiny,small --chunks 16,32,64 --left 128 --streams 1,8
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

from asrprec.models.zipformer import build_zipformer_encoder


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _context(policy: str, device: str):
    if policy == "amp-bf16":
        return torch.autocast(device, dtype=torch.bfloat16)
    if policy == "amp-fp16":
        return torch.autocast(device, dtype=torch.float16)
    return torch.autocast(device, enabled=False)


def measure(enc, policy: str, device: str, streams: int, chunk: int, left: int, seconds: float, runs: int):
    dtype = next(enc.parameters()).dtype
    frames = int(seconds * 100)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(streams, frames, enc.num_features, generator=g).to(device, dtype)
    lens = torch.full((streams,), frames, device=device)
    la = enc.streaming_lookahead
    padded = torch.nn.functional.pad(feats, (0, 0, 0, 2 * chunk + la))
    state_bytes = sum(s.numel() * s.element_size() for s in enc.get_init_states(1, chunk, left, device=device))
    stream_t, sim_t, chunk_ms = [], [], []
    with torch.inference_mode(), _context(policy, device):
        for run in range(runs + 1):  # run 0 warms up
            states = enc.get_init_states(streams, chunk, left, device=device)
            _sync(device)
            t0 = time.perf_counter()
            per_chunk = []
            for start in range(0, frames - 7, 2 * chunk):
                c0 = time.perf_counter()
                _, _, states = enc.streaming_forward(padded[:, start: start + 2 * chunk + la], lens - start, states)
                _sync(device)
                per_chunk.append(time.perf_counter() - c0)
            t1 = time.perf_counter()
            enc(feats, lens, chunk_size=chunk, left_context_frames=left)
            _sync(device)
            t2 = time.perf_counter()
            if run:
                stream_t.append(t1 - t0)
                sim_t.append(t2 - t1)
                chunk_ms.extend(x * 1e3 for x in per_chunk)
    audio = streams * seconds
    chunk_ms.sort()
    return {
        "chunk_ms": statistics.median(chunk_ms),
        "chunk_p90": chunk_ms[min(len(chunk_ms) - 1, int(0.9 * len(chunk_ms)))],
        "rtfx_stream": audio / statistics.median(stream_t),
        "rtfx_sim": audio / statistics.median(sim_t),
        "ratio": statistics.median(s / m for s, m in zip(stream_t, sim_t)),
        "state_kib": state_bytes / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny")
    p.add_argument("--policies", default="fp32", help="comma list of fp32, bf16 (cast), amp-bf16, amp-fp16")
    p.add_argument("--streams", default="1,8")
    p.add_argument("--chunks", default="16,32,64", help="chunk sizes in 50 Hz frames (16 = 320 ms)")
    p.add_argument("--left", type=int, default=128, help="left context in 50 Hz frames")
    p.add_argument("--seconds", type=float, default=10.0, help="audio per stream")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# streaming Zipformer, {platform.processor() or platform.machine()}, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else f'{torch.get_num_threads()} threads'}, "
          f"torch {torch.__version__}, {datetime.date.today()}; {args.seconds:g} s per stream, left context "
          f"{args.left} frames ({args.left * 20} ms), median of {args.runs} runs")
    print()
    print("| size | policy | streams | chunk | state / stream | ms per chunk (median) | p90 | RTFx streaming "
          "| RTFx simulated | time streaming / simulated |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        torch.manual_seed(0)
        base = build_zipformer_encoder(size=size, causal=True).eval().to(args.device)
        for policy in args.policies.split(","):
            enc = base.to(torch.bfloat16) if policy == "bf16" else base
            for streams in map(int, args.streams.split(",")):
                for chunk in map(int, args.chunks.split(",")):
                    r = measure(enc, policy, args.device, streams, chunk, args.left, args.seconds, args.runs)
                    print(f"| {size} | {policy} | {streams} | {chunk} ({chunk * 20} ms) | {r['state_kib']:.0f} KiB "
                          f"| {r['chunk_ms']:.1f} | {r['chunk_p90']:.1f} | {r['rtfx_stream']:.1f} "
                          f"| {r['rtfx_sim']:.1f} | {r['ratio']:.2f} |", flush=True)
            if policy == "bf16":
                base = base.float()


if __name__ == "__main__":
    main()
