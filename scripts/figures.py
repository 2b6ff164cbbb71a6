#!/usr/bin/env python3
"""Draws the comparison figures of README.md and docs/ as PNGs from the benches' own output.

    python3 scripts/figures.py                 # reads docs/figures/data/, writes docs/figures/
    python3 scripts/figures.py --list          # which PNG comes from which file and command

Each input in docs/figures/data/ is the text a bench printed (its table rows, `#` lines and
all); the command that printed it is listed in FIGURES below and in docs/figures.md. To
redraw a figure from a new run, save that command's output over the data file and run this
script again. Needs only the Python standard library (scripts/pngplot.py draws the PNGs).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pngplot as P  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# PNG -> (data files, the command that printed them, what it shows)
FIGURES = {
    "bytes_vs_ring.png": (
        ["attn_perf_host.txt"],
        "build/hsap_attn_perf -b 2048 -e 16384 -f 2 --ranks 4 --docs-dist longtail "
        "--tokens-per-doc 512 --heads 4 --kv-heads 2 --head-dim 64 --dtype bf16 -n 3 -w 1 -c 1 "
        "--ref-max-gflop 8",
        "K/V bytes received per rank against a naive ring, over the row length"),
    "topology_bytes.png": (
        ["attn_perf_nodes.txt"],
        "build/hsap_attn_perf -b 2048 -e 16384 -f 2 --ranks 4 --nodes 2 --docs-dist longtail "
        "--tokens-per-doc 512 --heads 4 --kv-heads 2 --head-dim 64 --dtype bf16 -n 1 -w 0 -c 0",
        "inter-node K/V bytes per rank, relayed through one rank per node against direct"),
    "planner_speedup.png": (
        ["plan_128k.txt", "plan_512k.txt", "plan_1m.txt"],
        "build/hsap_plan --brief --model models/llama3-8b.json --seq N clusters/*.json "
        "(N = 131072, 524288, 1048576)",
        "simulated speedup of the planner's plan over the strongest symmetric baseline"),
    "cpu_vs_pytorch.png": (
        ["kernel_bench_peer.txt"],
        "build/hsap_kernel_bench --tokens=4096 --heads_q=1 --heads_kv=1 --dtype=fp32 "
        "--dims=64,128 --threads=1 --nvrtc_limit=-1 --layouts=causal,full --peer=python3",
        "host attention kernels (JIT, hand-written) against PyTorch's CPU SDPA, one thread"),
    "h200_vs_cudnn.png": (
        ["h200_causal_32k.txt", "h200_packed_32k.txt", "h200_causal_128k.txt"],
        "build/hsap_attn_perf --backend cuda-loopback --ranks 1 --dtype bf16 --head-dim 128 "
        "--heads 16 --kv-heads 16 -b T -e T -n 10 -w 3 -c 0 --docs-dist single|longtail",
        "hsap's JIT CUDA kernels against cuDNN's fused attention on one H200"),
}


# ---- parsing the benches' output --------------------------------------------------------


def parse_size(text: str) -> float:
    """'377.00KB' -> bytes (the benches print B, KB, MB, GB in powers of 1024)."""
    m = re.fullmatch(r"([0-9.]+)(B|KB|MB|GB)", text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return float(m.group(1)) * {"B": 1, "KB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3}[m.group(2)]


def table(path: Path, first_column: str) -> list[dict[str, str]]:
    """Rows of a bench table: the header is the last '#' line whose first word is
    first_column; each row below it that is not a '#' line maps column names to fields
    (hsap_attn_perf's two-word columns 'bytes max' and 'bytes mean' are 'max' and 'mean')."""
    header, rows = None, []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            words = line[1:].replace("bytes max", "max").replace("bytes mean", "mean").split()
            if words and words[0] == first_column:
                header = words
            continue
        if header and line.strip():
            fields = line.split()
            if len(fields) == len(header):
                rows.append(dict(zip(header, fields)))
    if not rows:
        raise ValueError(f"{path}: no rows under a '# {first_column} ...' header")
    return rows


def plan_rows(path: Path) -> list[dict[str, str]]:
    """hsap_plan --brief: the cluster, then (devices, free text), then 12 columns."""
    names = ["hsap_tok/s", "base_tok/s", "baseline", "speedup", "e2e_x", "of_hw", "of_model",
             "comp", "expos", "imbal", "search_ms", "base_ms"]
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        fields = line.split()
        rows.append({"cluster": fields[0], **dict(zip(names, fields[-12:]))})
    return rows


def cudnn_lines(path: Path) -> dict[str, float]:
    """'# cuDNN  32768 fwd(ms) 7.496 fwdTF/s 586.7693 ...' -> {'fwd': 586.77, 'bwd': ...}."""
    out = {}
    seen = set()  # with --threads=1 the bench prints each shape twice: the first is drawn
    for m in re.finditer(r"^# cuDNN\s+\d+ (fwd|bwd)\(ms\)\s+\S+ \w+TF/s\s+([0-9.]+)",
                         path.read_text(), re.M):
        out[m.group(1)] = float(m.group(2))
    return out


# ---- the figures -------------------------------------------------------------------------


def tokens_label(t: int) -> str:
    return f"{t // 1048576}M" if t % 1048576 == 0 else f"{t // 1024}K"


def bytes_vs_ring(data: Path, out: Path) -> None:
    rows = table(data / "attn_perf_host.txt", "tokens")
    cats = [f"{tokens_label(int(r['tokens']))}: {float(r['ratio']):.0%} OF RING" for r in rows]
    kb = lambda key: [parse_size(r[key]) / 1024 for r in rows]  # noqa: E731
    P.bar_chart(
        out, "K/V BYTES RECEIVED PER RANK IN ONE FORWARD: HSAP VS A NAIVE RING", "KB PER RANK",
        cats, [("NAIVE RING (EVERY K/V ROW TO EVERY RANK)", kb("ring"), P.GREY),
               ("HSAP, BUSIEST RANK", kb("max"), P.ORANGE),
               ("HSAP, MEAN OVER RANKS", kb("mean"), P.BLUE)],
        subtitle="4 HOST RANKS, BF16, 2 KV HEADS, HEAD DIM 64, LONG-TAILED DOCUMENTS OF 512 "
                 "TOKENS MEAN",
        value_format="{:.0f}", category_label="TOKENS IN THE PACKED ROW: HSAP MEAN / RING")


def topology_bytes(data: Path, out: Path) -> None:
    rows = table(data / "attn_perf_nodes.txt", "tokens")
    cats = [tokens_label(int(r["tokens"])) for r in rows]
    kb = lambda key: [parse_size(r[key]) / 1024 for r in rows]  # noqa: E731
    P.bar_chart(
        out, "K/V BYTES PER RANK CROSSING NODES: RELAYED VS DIRECT DELIVERY", "KB PER RANK",
        cats, [("DIRECT DELIVERY: INTER-NODE", kb("direct"), P.GREY),
               ("HSAP, RELAYED: INTER-NODE", kb("inter"), P.BLUE),
               ("HSAP, RELAYED: INTRA-NODE", kb("intra"), P.GREEN)],
        subtitle="4 HOST RANKS AS 2 NODES OF 2, BF16 (HSAP_ATTN_PERF --NODES 2)",
        value_format="{:.0f}", category_label="TOKENS IN THE PACKED ROW")


def planner_speedup(data: Path, out: Path) -> None:
    runs = [("128K TOKENS", "plan_128k.txt", P.BLUE), ("512K TOKENS", "plan_512k.txt", P.ORANGE),
            ("1M TOKENS", "plan_1m.txt", P.GREEN)]
    tables = [plan_rows(data / f) for _, f, _ in runs]
    clusters = [r["cluster"] for r in tables[0]]
    series = []
    for (label, _, color), rows in zip(runs, tables):
        by = {r["cluster"]: float(r["speedup"].rstrip("x")) for r in rows}
        series.append((label, [by[c] for c in clusters], color))
    P.hbar_chart(
        out, "SIMULATED SPEEDUP OVER THE STRONGEST SYMMETRIC BASELINE (RING, ULYSSES, USP, TE)",
        "HSAP PLAN TOKENS/S / BEST BASELINE TOKENS/S (ATTENTION FWD + BWD, LLAMA 3 8B)",
        clusters, series, value_format="{:.2f}", reference=1.0,
        subtitle="HSAP_PLAN --BRIEF, PRICED BY THE RUN SIMULATOR (NO GPU CLUSTER USED)")


def cpu_vs_pytorch(data: Path, out: Path) -> None:
    text = (data / "kernel_bench_peer.txt").read_text()
    cats, torch_ms, jit_ms, hand_ms = [], [], [], []
    seen = set()  # with --threads=1 the bench prints each shape twice: the first is drawn
    for m in re.finditer(r"^\s+(\w+)\s+(\d+)\s+(fwd|bwd)\s+1 torch_ms\s+([0-9.]+)\s+hand_ms\s+"
                         r"([0-9.]+)\s+torch/hand\s+\S+\s+jit_ms\s+([0-9.]+)", text, re.M):
        if m.group(1, 2, 3) in seen:
            continue
        seen.add(m.group(1, 2, 3))
        cats.append(f"{m.group(1)} D{m.group(2)}\n{m.group(3)}")
        torch_ms.append(float(m.group(4)))
        hand_ms.append(float(m.group(5)))
        jit_ms.append(float(m.group(6)))
    if not cats:
        raise ValueError("kernel_bench_peer.txt: no 'torch_ms' lines (run with --peer)")
    P.bar_chart(
        out, "HOST ATTENTION, FP32, 4096 TOKENS, 1 HEAD, 1 THREAD: MS PER CALL (LOWER IS BETTER)",
        "MS", cats, [("PYTORCH SDPA (CPU)", torch_ms, P.ORANGE),
                     ("HSAP JIT KERNEL", jit_ms, P.BLUE),
                     ("HSAP HAND-WRITTEN KERNEL", hand_ms, P.GREY)],
        subtitle="HSAP_KERNEL_BENCH --PEER: ONE RUN ON A SHARED 2-CORE MACHINE, CPU TIME, BEST OF 3",
        value_format="{:.0f}", width=900)


def h200_vs_cudnn(data: Path, out: Path) -> None:
    runs = [("32K CAUSAL", "h200_causal_32k.txt"), ("32K PACKED", "h200_packed_32k.txt"),
            ("128K CAUSAL", "h200_causal_128k.txt")]
    cats, ours, cudnn = [], [], []
    for direction in ("fwd", "bwd"):
        for label, name in runs:
            row = table(data / name, "tokens")[0]
            cats.append(f"{label}\n{direction}")
            ours.append(float(row[f"{direction}TF/s"]))
            cudnn.append(cudnn_lines(data / name)[direction])
    P.bar_chart(
        out, "ONE H200, BF16, HEAD DIM 128, 16 HEADS: TFLOP/S OVER VISIBLE PAIRS", "TFLOP/S",
        cats, [("CUDNN 9.19 FUSED ATTENTION", cudnn, P.GREY),
               ("HSAP JIT KERNELS (MMA.SYNC)", ours, P.BLUE)],
        subtitle="HSAP_ATTN_PERF --BACKEND CUDA-LOOPBACK --RANKS 1, 2026-12-04 (FIRST GPU RUN)",
        value_format="{:.0f}", width=900)


DRAW = {"bytes_vs_ring.png": bytes_vs_ring, "topology_bytes.png": topology_bytes,
        "planner_speedup.png": planner_speedup, "cpu_vs_pytorch.png": cpu_vs_pytorch,
        "h200_vs_cudnn.png": h200_vs_cudnn}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(ROOT / "docs/figures/data"), help="bench outputs")
    p.add_argument("--out", default=str(ROOT / "docs/figures"), help="where the PNGs go")
    p.add_argument("--list", action="store_true", help="print each PNG's data and command")
    p.add_argument("names", nargs="*", help="only these PNGs (default: all)")
    args = p.parse_args()
    if args.list:
        for name, (files, command, what) in FIGURES.items():
            print(f"{name}: {what}\n  data: {', '.join(files)}\n  command: {command}")
        return 0
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.names or list(DRAW):
        if name not in DRAW:
            print(f"unknown figure {name}; one of {', '.join(DRAW)}", file=sys.stderr)
            return 2
        try:
            DRAW[name](data, out / name)
            print(f"wrote {out / name}")
        except (OSError, ValueError, KeyError) as e:
            print(f"{name}: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
