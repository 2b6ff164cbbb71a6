"""The hybrid-layer case of hf_llama_cp.py: a Qwen2 whose layers mix full attention and a
sliding window of 32 tokens (Gemma / gpt-oss / Mistral-style hybrids), trained with hsap
context parallelism. Both masks share one partition of each row (balanced for the sum of
the layers' work), so the model's tokens are sharded once for all layers; the windows apply
per document (a document shorter than the window attends to all of itself).

    torchrun --nproc-per-node 4 examples/hf_hybrid_cp.py      # options as hf_llama_cp.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_llama_cp import exit_now, main  # noqa: E402

if __name__ == "__main__":
    exit_now(main(default_model="qwen2-hybrid"))
