"""A tiny model trained until it reproduces two tool-calling conversations (one with a call that fails validation),
so that tool rollouts run on real `generate` output (tests/test_tools.py, tests/test_trl_rewards.py)."""

from __future__ import annotations

import json
from typing import Any

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from lightning_rl.tools import Tool, ToolExecutor, parse_tool_calls
from lightning_rl.tools.builtin import calculator
from lightning_rl.toy.model import tiny_model_path

GOOD_CALL = {"name": "calculator", "arguments": {"operation": "add", "a": "7", "b": 5}}
BAD_CALL = {"name": "calculator", "arguments": {"operation": "add", "a": "seven", "b": 1}}


def _conversation(question: str, call: dict, result: str, answer: str) -> list[dict]:
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "name": call["name"], "content": result},
        {"role": "assistant", "content": answer},
    ]


def train_tool_calling_model() -> tuple[Any, Any, list[list[int]], str]:
    """A small model trained here until it reproduces two tool-calling conversations (one with a
    call that fails validation), so the rollout loop runs on real generate output."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    executor = ToolExecutor([Tool.from_function(calculator)])
    bad_result = executor.run(parse_tool_calls(f"<tool_call>{json.dumps(BAD_CALL)}</tool_call>")[0]).content
    conversations = [_conversation("7+5=", GOOD_CALL, "12", "12"), _conversation("7+1=", BAD_CALL, bad_result, "8")]
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config)
    encoded = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
               for c in conversations]
    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id)
    trained = torch.zeros(len(encoded), width, dtype=torch.bool)
    for i, enc in enumerate(encoded):
        ids[i, : len(enc["input_ids"])] = torch.tensor(enc["input_ids"])
        trained[i, : len(enc["input_ids"])] = torch.tensor(enc["assistant_masks"], dtype=torch.bool)
    targets, trained = ids[:, 1:], trained[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):  # until greedy decoding reproduces every assistant token
        logits = model(ids).logits[:, :-1]
        if (logits.argmax(-1) == targets)[trained].all():
            break
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        optimizer.zero_grad()
        (-logp[trained].mean()).backward()
        optimizer.step()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    prompts = [tokenizer.apply_chat_template(c[:1], tokenize=True, return_dict=False, add_generation_prompt=True)
               for c in conversations]
    return model.eval(), tokenizer, prompts, bad_result
