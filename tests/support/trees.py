"""Packed rows the tree-attention tests share, and the references they are checked against."""

import torch

from lightning_rl.attention import tree_attention
from lightning_rl.attention.tree_attention import attend_tree


def reference_logprobs(model, seqs, masks):
    """Each sequence alone, through the model's own forward and logits."""
    out = []
    for s, m in zip(seqs, masks):
        logits = model(input_ids=torch.tensor([s])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(s[1:])[:, None]).squeeze(1)
        out.append(logp[torch.tensor(m[1:], dtype=torch.bool)])
    return torch.cat(out)


NESTED = [
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],  # system + user turn, answer A, then a tool turn ...
    [3, 4, 5, 6, 7, 8, 9, 10, 20, 21, 22, 23],  # ... that forks
    [3, 4, 5, 6, 7, 8, 30, 31, 32, 33, 34],  # answer B forks earlier
    [3, 4, 5, 6, 7, 8, 30, 31, 40, 41],  # and forks again (nested fork)
    [3, 4, 5, 6, 7, 8, 30, 31, 40, 41],  # identical rollout
    [50, 51],  # another prompt, no sharing
    [3, 60],  # single-token branch right after the root
]

BRANCHY = [[3, 4, 5] + [6 + i] * (1 + i % 5) + [20 + i] * (i % 3) for i in range(12)]  # short branches, many lengths


def attention_and_grads(meta, q, k, v, grad_out, window):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attend_tree(q, k, v, meta, window=window)
    return (out, *torch.autograd.grad(out, (q, k, v), grad_out))


honest_attend_tree = tree_attention.attend_tree


def leaky_beyond(tokens: int):
    """An attention that is right on rows of up to ``tokens`` tokens and, beyond, attends causally over the whole
    row, as a missing mask would: every sequence then sees the ones packed before it."""

    def attend(q, k, v, meta, *, scale=None, window=None):
        if meta.num_tokens <= tokens:
            return honest_attend_tree(q, k, v, meta, scale=scale, window=window)
        groups = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(groups, dim=1) for x in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    return attend
