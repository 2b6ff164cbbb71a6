#!/usr/bin/env python3
"""The cost model against measurements: the validation table of docs/cost_model.md.

Runs build/hsap_plan (the planner's own pricing: the run simulator over the runtime's
programs, under the shipped calibration) on the configuration of each measurement and prints
one Markdown row per figure: source, configuration, measured, predicted, predicted/measured.
Sources and how each figure is derived from them are in docs/cost_model.md, section 6.

    python3 scripts/validate_cost_model.py [--plan build/hsap_plan] [--json OUT.json]
    python3 scripts/validate_cost_model.py --check docs/cost_model.md

--check (the ctest docs_cost_model_validation): the table between the markers in that file
must be what the script prints now, figure for figure (predictions within 0.5 %), and every
ratio within 0.8-1.25, so that the predictions cannot drift without the table saying so.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Models (attention shapes; layers matter only end to end).
MODELS = {
    "mha16": {"name": "16 heads d128", "layers": 1, "heads_q": 16, "heads_kv": 16,
              "head_dim": 128, "hidden": 2048},
    "llama3-8b": os.path.join(ROOT, "models", "llama3-8b.json"),
    # One layer of it: the attention measurements hold no weights or optimizer state.
    "llama3-8b-layer": {"name": "Llama 3 8B, one layer", "layers": 1, "heads_q": 32,
                        "heads_kv": 8, "head_dim": 128, "hidden": 4096, "ffn_hidden": 14336},
}
# Clusters. H800: an H100 whose NVLink is cut to 400 GB/s total (200 per direction).
CLUSTERS = {
    "1xH200": {"nodes": [{"kind": "H200", "devices": 1}]},
    "1xH100": {"nodes": [{"kind": "H100", "devices": 1}]},
    "1xA100": {"nodes": [{"kind": "A100", "devices": 1}]},
    "1xH800": {"device_kinds": {"H100": {"intra_node_gbps": 200}},
               "nodes": [{"kind": "H100", "devices": 1}]},
    "8xH800": {"device_kinds": {"H100": {"intra_node_gbps": 200}},
               "nodes": [{"kind": "H100", "devices": 8}]},
    "8xA100": {"nodes": [{"kind": "A100", "devices": 8}]},
    "16xA800": {"nodes": [{"kind": "A800", "devices": 8, "nics": 4, "nic_gbps": 25,
                           "count": 2}]},
}


class Planner:
    def __init__(self, binary, tmp):
        self.binary, self.tmp, self.cache = binary, tmp, {}

    def _file(self, name, table):
        value = table[name]
        if isinstance(value, str):
            return value
        path = os.path.join(self.tmp, name + ".json")
        with open(path, "w") as f:
            json.dump(value, f)
        return path

    def run(self, cluster, model, seq, engine, extra=()):
        """hsap_plan's output: {layout: (fwd_ms, bwd_ms)}, the e2e line's figures, priced."""
        key = (cluster, model, seq, engine, tuple(extra))
        if key in self.cache:
            return self.cache[key]
        cmd = [self.binary, "--cluster", self._file(cluster, CLUSTERS), "--model",
               self._file(model, MODELS), "--seq", str(seq), "--engine", engine, *extra]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows = {}
        for line in out.splitlines():
            m = re.match(r"^  (\S+(?: a2a\+p2p)?)\s+.*?\s+([0-9.]+)\s+([0-9.]+)\s+[0-9]+\s+"
                         r"[0-9.]+x\s+[0-9.]+%$", line)
            if m:
                rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
        e2e = re.search(r"^# end to end .*: hsap ([0-9]+) tokens/s, (.+?) ([0-9]+) tokens/s",
                        out, re.M)
        priced = re.search(r"^# priced: (.*)$", out, re.M).group(1)
        result = {"rows": rows, "priced": priced,
                  "e2e": (float(e2e.group(1)), e2e.group(2), float(e2e.group(3)))}
        self.cache[key] = result
        return result


def causal_flops(tokens, heads, head_dim=128):
    return 4.0 * head_dim * tokens * (tokens + 1) / 2 * heads


def rows(p):
    """(source, configuration, figure, measured, predicted, in_sample) per measurement."""
    out = []
    # 1. H200, one GPU, 16 heads d 128, one causal document (docs/gpu_backend.md).
    h200 = {("cudnn", 32768): (7.496, 21.279), ("jit", 32768): (32.038, 118.673),
            ("cudnn", 131072): (130.254, 336.244), ("jit", 131072): (494.085, 1978.141)}
    for (engine, seq), (fwd, bwd) in h200.items():
        got = p.run("1xH200", "mha16", seq, engine)["rows"]["hsap"]
        out.append(("H200 measured 2026-12 (gpu_backend.md)",
                    f"1 GPU, {engine}, {seq // 1024}K causal, 16x128",
                    "fwd + bwd ms", fwd + bwd, got[0] + got[1], True))
    # 2. Single GPU, published kernels, TFLOP/s of one causal call (FLOPs over visible pairs).
    def tflops(cluster, model, seq, engine, heads, backward):
        fwd, bwd = p.run(cluster, model, seq, engine)["rows"]["hsap"]
        flops = causal_flops(seq, heads) * (2.5 if backward else 1.0)
        return flops / ((bwd if backward else fwd) * 1e-3) / 1e12
    for seq, fwd in ((4096, 579), (8192, 602)):
        out.append(("FlashAttention-3 paper, Fig. 5 (H100 SXM5)",
                    f"1 GPU, fa3, {seq // 1024}K causal, 16x128", "fwd TFLOP/s", fwd,
                    tflops("1xH100", "mha16", seq, "fa3", 16, False), True))
    for seq, fwd in ((4096, 319), (8192, 333)):
        out.append(("FlashAttention-3 paper, Fig. 5: FlashAttention-2 on H100",
                    f"1 GPU, fa2, {seq // 1024}K causal, 16x128", "fwd TFLOP/s", fwd,
                    tflops("1xH100", "mha16", seq, "fa2", 16, False), True))
    # ring-flash-attention README: flash_attn (FA2) alone, Llama 3.1 8B heads (GQA 32:8),
    # 8K causal, batch 1: fwd 591.5 / 373.4 iter/s, fwd + bwd 154.7 / 94.7 iter/s (H800 / A100).
    f8k = causal_flops(8192, 32) * 8192 / 8193  # the README's FLOP convention: S^2 / 2
    for gpu, cluster, fwd_it, both_it, in_sample in (("H800", "1xH800", 591.5, 154.7, False),
                                                      ("A100", "1xA100", 373.4, 94.7, True)):
        measured_fwd = fwd_it * f8k / 1e12
        measured_bwd = 2.5 * f8k / (1 / both_it - 1 / fwd_it) / 1e12
        for backward, measured in ((False, measured_fwd), (True, measured_bwd)):
            out.append((f"ring-flash-attention README: flash_attn on {gpu}",
                        "1 GPU, fa2, 8K causal, Llama 3 8B heads (32:8)",
                        "bwd TFLOP/s" if backward else "fwd TFLOP/s", measured,
                        tflops(cluster, "llama3-8b-layer", 8192, "fa2", 32, backward), in_sample))
    # 3. Multi-GPU: zigzag ring attention over 8 GPUs (NVLink), 8K tokens per GPU, against 8x
    # the single GPU's flash_attn on 8K (the README's "theoretic"): fraction of that ideal.
    for gpu, one, eight, fwd_frac, both_frac in (("H800", "1xH800", "8xH800", 85.2, 90.2),
                                                  ("A100", "1xA100", "8xA100", 81.7, 89.8)):
        single = p.run(one, "llama3-8b-layer", 8192, "fa2")["rows"]["hsap"]
        ring = p.run(eight, "llama3-8b-layer", 65536, "fa2")["rows"]["Ring"]
        out.append((f"ring-flash-attention README: zigzag ring on 8x{gpu}",
                    "8 GPUs, fa2, 64K causal, Llama 3 8B heads", "fwd % of ideal", fwd_frac,
                    100 * 8 * single[0] / ring[0], False))
        out.append((f"ring-flash-attention README: zigzag ring on 8x{gpu}",
                    "8 GPUs, fa2, 64K causal, Llama 3 8B heads", "fwd+bwd % of ideal",
                    both_frac, 100 * 8 * sum(single) / sum(ring), False))
    # 4. End to end: USP (Fang & Zhao 2024), Llama 3 8B, 2 nodes of 8 A800, 208K tokens: 47 %
    # MFU. Predicted: the strongest symmetric layout's tokens/s end to end (attention,
    # projections and MLP, recompute) x model FLOPs per token / the 16 GPUs' peak.
    seq = 208 * 1024
    e2e = p.run("16xA800", "llama3-8b", seq, "fa2")["e2e"]
    layers, hidden, ffn, hq, hkv, d = 32, 4096, 14336, 32, 8, 128
    dense = 2.0 * (hidden * (2 * hq + 2 * hkv) * d + 3 * hidden * ffn)
    per_token = layers * (3 * dense + 3.5 * causal_flops(seq, hq) / seq)
    out.append(("USP paper (Fang & Zhao 2024): Llama 3 8B on 2x8 A800",
                "16 GPUs, fa2, 208K causal, e2e (" + e2e[1] + ")", "MFU %", 47.0,
                100 * e2e[2] * per_token / (16 * 312e12), False))
    return out


BEGIN, END = "<!-- validation table: scripts/validate_cost_model.py -->", "<!-- end -->"


def check(table, path):
    """0 when the file's table is the script's, every ratio in 0.8-1.25; else 1, saying why."""
    text = open(path).read()
    if BEGIN not in text:
        print(f"FAIL: {path} has no line {BEGIN}")
        return 1
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    written = [line for line in body.splitlines() if line.startswith("| ") and
               not line.startswith("| source")]
    errors = []
    if len(written) != len(table):
        errors.append(f"{path} has {len(written)} rows, the script {len(table)}")
    for line, (source, config, figure, measured, predicted, _) in zip(written, table):
        cells = [c.strip() for c in line.strip("|").split("|")]
        what = f"{source} / {config} / {figure}"
        if cells[:3] != [source, config, figure]:
            errors.append(f"row {cells[:3]} is not {what}")
            continue
        if abs(float(cells[4]) - predicted) > max(0.1, 0.005 * predicted):
            errors.append(f"{what}: the table says {cells[4]}, the model now {predicted:.1f}")
        if not 0.8 <= predicted / measured <= 1.25:
            errors.append(f"{what}: ratio {predicted / measured:.2f} outside 0.8-1.25")
    for e in errors:
        print("FAIL:", e)
    print("validation table:", "differs" if errors else f"{len(table)} rows as written")
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default=os.path.join(ROOT, "build", "hsap_plan"))
    ap.add_argument("--json", help="also write the rows there")
    ap.add_argument("--check", help="compare with the table in this Markdown file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(Planner(args.plan, tmp))
    if args.check:
        return check(table, args.check)
    print("| source | configuration | figure | measured | predicted | ratio | in sample |")
    print("|---|---|---|---:|---:|---:|---|")
    for source, config, figure, measured, predicted, in_sample in table:
        print(f"| {source} | {config} | {figure} | {measured:.1f} | {predicted:.1f} | "
              f"{predicted / measured:.2f} | {'yes' if in_sample else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"source": s, "config": c, "figure": g, "measured": m, "predicted": p,
                        "in_sample": i} for s, c, g, m, p, i in table], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
