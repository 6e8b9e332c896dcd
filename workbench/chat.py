"""Chat formatting: a conversation as token ids with an exact mask over assistant tokens.

Why its own module: capture, regeneration, the engine's prompts and serving all render chats
the same way; nothing here depends on where the prompts came from (workbench.data).
"""

from __future__ import annotations

from workbench.errors import DataError

Message = dict[str, str]  # {"role": "system"|"user"|"assistant", "content": str}


def encode_conversation(
    tokenizer, messages: list[Message], max_length: int | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids of a chat-templated conversation and a mask over assistant tokens.

    Built turn by turn so the mask is exact: the tokens added by an assistant message
    (its content and end-of-turn marker) are masked in; the template's generation prompt
    (`<|im_start|>assistant\\n`) is not, since the draft never has to predict it.
    """
    ids: list[int] = []
    mask: list[bool] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
            if prefix[: len(ids)] != ids:
                raise DataError(
                    "chat template is not prefix-stable; cannot build an exact loss mask"
                )
            mask += [False] * (len(prefix) - len(ids))
            ids = prefix
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(ids)] != ids:
            raise DataError("chat template is not prefix-stable; cannot build an exact loss mask")
        mask += [m["role"] == "assistant"] * (len(full) - len(ids))
        ids = full
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, messages: list[Message]) -> list[int]:
    """Ids of a conversation ending in a user turn, with the assistant generation prompt."""
    return _render(tokenizer, messages, add_generation_prompt=True)


def eos_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
