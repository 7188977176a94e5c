"""Two random Mistral-shaped checkpoints of one layer (window 4096, and global attention) and 10
documents of 8192 random tokens, for scripts/bench_window_work.sh. Usage: make_window_models.py DIR"""
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
out = sys.argv[1]
for name, window in [("window4k", 4096), ("global", None)]:
    cfg = AutoConfig.for_model("mistral", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=65536, sliding_window=window, pad_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(f"{out}/{name}")
import random
random.seed(0)
docs = [[random.randrange(256) for _ in range(8192)] for _ in range(10)]
json.dump(docs, open(f"{out}/docs.json", "w"))
