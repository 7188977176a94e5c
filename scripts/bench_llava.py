#!/usr/bin/env python3
"""transformers + PyTorch LLaVA training throughput, next to `cpl train` (issue 15; run
scripts/bench_llava.sh).

Builds (once) `target/bench/llava-bench`: the 4-layer hidden-512 LLaMA of scripts/bench_eval.py
(vocab 32000) with a small CLIP tower (image 224, patch 16 -> 196 patches, hidden 384, 4
layers, 6 heads) and the 2-layer projector, saved with save_pretrained, plus the tiny LLaVA
fixture's tokenizer and image processor (resized to 224). Times AdamW steps (forward,
backward, clip 1.0, step) on one sequence of --seq-len tokens holding one image (196 image
tokens), labels on the text after the image; best of --repeats after one warm-up, sdpa.
Prints JSON with tokens/s and peak RSS.
"""
import argparse
import json
import os
import resource
import shutil
import time

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="target/bench")
    a = p.parse_args()
    torch.manual_seed(0)
    out = os.path.join(a.dir, "llava-bench")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        text = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=8, vocab_size=32000, max_position_embeddings=max(a.seq_len, 4096),
                           tie_word_embeddings=False)
        vision = CLIPVisionConfig(image_size=224, patch_size=16, hidden_size=384, intermediate_size=1536,
                                  num_hidden_layers=4, num_attention_heads=6)
        cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_index=256, image_seq_length=196,
                          vision_feature_layer=-2, vision_feature_select_strategy="default")
        LlavaForConditionalGeneration(cfg).save_pretrained(out)
        fx = "tests/fixtures/llava/clip"
        for f in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(os.path.join(fx, f), out)
        pc = json.load(open(os.path.join(fx, "preprocessor_config.json")))
        pc["size"] = {"shortest_edge": 224}
        pc["crop_size"] = {"height": 224, "width": 224}
        json.dump(pc, open(os.path.join(out, "preprocessor_config.json"), "w"), indent=2)
    model = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").train()
    ids = torch.randint(3, 250, (1, a.seq_len), generator=torch.Generator().manual_seed(1))
    ids[0, 8:8 + 196] = 256
    labels = ids.clone()
    labels[0, : 8 + 196] = -100
    pv = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(input_ids=ids, pixel_values=pv, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    best = float("inf")
    for _ in range(a.repeats):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(), "seq_len": a.seq_len,
                      "seconds": best, "tokens_per_sec": a.seq_len / best,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
