"""Where a training step of the shipped encoder recipe spends its CPU time, per variant (issue 15 item 2):
torch.profiler over 4 steps (forward, backward, AdamW) after 2 warm-up steps, the 14 operators with the
most self CPU time. Random tokens, as ``attnlab train speed``.

    python scripts/profile_train_step.py [unas dnas hnas]
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from attnlab.data import IGNORE_INDEX
from attnlab.models import TransformerLM
from attnlab.train.config import load_recipe

recipe = load_recipe("enc-unas")
vocab = 261 if recipe.data.tokenizer == "byte" else recipe.data.vocab_size
for variant in sys.argv[1:] or ["unas", "dnas", "hnas"]:
    torch.manual_seed(0)
    cfg = recipe.model_config(vocab)
    cfg.variant = variant
    model = TransformerLM(type(cfg).from_dict(cfg.to_dict())).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    B, T = recipe.train.batch_size, recipe.data.seq_len
    ids = torch.randint(5, vocab, (B, T))
    labels = torch.where(torch.rand(B, T) < 0.15, ids, torch.full_like(ids, IGNORE_INDEX))

    def step(model=model, opt=opt, ids=ids, labels=labels):
        model(ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            step()
    print(f"===== {variant}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
