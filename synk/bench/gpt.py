"""minGPT, the model pytorch/examples' ``distributed/minGPT-ddp`` trains, and its step, which
``synk.bench.frameworks`` runs through synk and under torch DDP on gloo.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    """minGPT-ddp's ``gpt_config`` and ``data_config.block_size``: the configuration of that
    example's ``gpt2_train_cfg.yaml`` (25.3M parameters)."""

    vocab_size: int = 65
    block_size: int = 128
    n_layer: int = 8
    n_head: int = 8
    n_embd: int = 512
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    """Multi-head masked self-attention with a projection at the end."""

    bias: torch.Tensor  # the causal mask (a buffer)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        mask = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    """A transformer block: attention, then an MLP, each on a layer norm of a residual."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),  # minGPT's c_fc, act, c_proj
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The GPT language model: ``model(idx, targets)`` is ``(logits, loss)``. Karpathy's
    minGPT (``mingpt/model.py``): token and position embeddings, blocks of causal
    self-attention and a GELU MLP, each after a layer norm, a linear head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.Sequential(*[Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith(("attn.c_proj.weight", "mlp.2.weight")):  # minGPT's c_proj
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.h(self.drop(self.wte(idx) + self.wpe(pos)))
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


def make_model(config: GPTConfig | None = None) -> tuple:
    """(a GPT of ``config``, default minGPT-ddp's, its AdamW), the same at every call."""
    torch.manual_seed(0)
    model = GPT(config or GPTConfig())
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def tokens(rows: int = 512, config: GPTConfig | None = None) -> tuple:
    """(inputs, targets): ``rows`` random sequences of ``block_size`` tokens, and the same
    sequences one token on, as minGPT-ddp's ``CharDataset`` gives them."""
    config = config or GPTConfig()
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, config.vocab_size, (rows, config.block_size + 1), generator=g)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: bool) -> torch.Tensor:
    """The loss as minGPT-ddp's trainer computes it (``Trainer._run_batch``; under autocast when
    ``amp``). On CPUs AMP is ``torch.autocast("cpu", torch.bfloat16)``, which needs no gradient
    scaler (bfloat16 has float32's range), where the CUDA example's float16 takes one."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        return model(x, y)[1]


def update(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The trainer's update after backward: the gradients' norm clipped to 1, AdamW's step
    (learning rate 3e-4, weight decay 0.1: ``make_model``)."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
