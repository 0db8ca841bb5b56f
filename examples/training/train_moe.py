#!/usr/bin/env python3
"""A few optimizer steps of a small MoE language-model block with moegraph.torch.MoELayer as a
drop-in feed-forward layer: embedding -> RMSNorm -> MoE -> output projection, next-token loss on
random data, AdamW. Prints the loss per step; the loss must fall (exit 1 otherwise).

Run: MOEGRAPH_LIBRARY=build/src/libmoegraph.so.0 PYTHONPATH=python python3 examples/training/train_moe.py"""
import argparse
import sys

import torch

from moegraph.torch import MoELayer


class Block(torch.nn.Module):
    def __init__(self, vocab, hidden, experts, ffn, top_k, tokens):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden, device="cuda", dtype=torch.bfloat16)
        self.norm = torch.nn.RMSNorm(hidden, device="cuda", dtype=torch.bfloat16)
        self.moe = MoELayer(experts, hidden, ffn, top_k=top_k, max_tokens=tokens, aux_loss_coef=0.01)
        self.head = torch.nn.Linear(hidden, vocab, device="cuda", dtype=torch.bfloat16)

    def forward(self, ids):
        h = self.embed(ids)
        y, aux = self.moe(self.norm(h))
        return self.head(h + y), aux


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()
    torch.manual_seed(0)
    vocab = 512
    model = Block(vocab, hidden=256, experts=16, ffn=256, top_k=2, tokens=args.tokens)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # in place: the layer's bound weights stay valid
    data = torch.randint(0, vocab, (args.tokens + 1,), device="cuda")
    losses = []
    for step in range(args.steps):
        logits, aux = model(data[:-1])
        loss = torch.nn.functional.cross_entropy(logits.float(), data[1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the aux loss gradient is applied inside the MoE layer's backward
        opt.step()
        losses.append(loss.item())
        print(f"step {step:3d}  loss {losses[-1]:.4f}  aux {float(aux):.4f}")
    if not losses[-1] < losses[0]:
        print("train_moe: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
