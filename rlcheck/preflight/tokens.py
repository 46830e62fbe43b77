"""Tokenizers: do the two sides turn text into the same ids, and does the chat template open a prompt
with BOS twice?

    findings = check_tokenizers(trainer_tokenizer, engine_tokenizer)
    findings = check_double_bos(tokenizer, "trainer")

The BOS test: render one user message with the chat template (text), then tokenize that text with
`add_special_tokens=True` (the default of `tokenizer(text)` and of vLLM's `generate(text)`): when the
template writes BOS and the tokenizer adds it again, the ids start with BOS twice. A side that tokenizes
the rendered text that way sees a different prompt from one that tokenizes in `apply_chat_template`.
"""

from __future__ import annotations

from typing import Any

from rlcheck.preflight.findings import Finding

SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")
PROBE_MESSAGE = [{"role": "user", "content": "What is 12+7?"}]


def specials(tokenizer: Any) -> dict[str, Any]:
    """{"bos_token": ("<s>", 1), ...}: each special token and its id (None where the tokenizer has none)."""
    out = {}
    for name in SPECIALS:
        token = getattr(tokenizer, name, None)
        out[name] = None if token is None else (str(token), getattr(tokenizer, f"{name}_id", None))
    return out


def check_tokenizers(trainer: Any, engine: Any) -> list[Finding]:
    """Vocabulary, special tokens and chat template of the two tokenizers."""
    out = []
    tv, ev = trainer.get_vocab(), engine.get_vocab()
    if tv != ev:
        differing = sorted(t for t in set(tv) | set(ev) if tv.get(t) != ev.get(t))
        out.append(Finding(
            "tokenizer_vocab", "critical", f"{len(tv)} tokens", f"{len(ev)} tokens",
            f"the vocabularies differ in {len(differing)} tokens (e.g. {differing[:3]}): the same id is a "
            "different string on the two sides, so the comparison pairs different tokens.",
            "Load one tokenizer on both sides (the trainer's, e.g. vLLM tokenizer=<the trainer's folder>)."))
    ts, es = specials(trainer), specials(engine)
    if ts != es:
        diff = [k for k in SPECIALS if ts[k] != es[k]]
        out.append(Finding(
            "special_tokens", "error", {k: ts[k] for k in diff}, {k: es[k] for k in diff},
            f"the sides disagree on {', '.join(diff)}: prompts open, pad or stop differently (where a "
            "sequence ends, and whether the stop token's logprob is counted).",
            "Load one tokenizer on both sides, or set the same special tokens in both tokenizer configs."))
    if getattr(trainer, "chat_template", None) != getattr(engine, "chat_template", None):
        out.append(Finding(
            "chat_template", "warn", _short(trainer), _short(engine),
            "the chat templates differ: a side that renders conversations itself builds other prompt ids "
            "than the side that sent them (retokenization).",
            "Render prompts once (on the trainer side) and send token ids to the engine, or use one chat template."))
    return out


def _short(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return None
    text = str(template)
    return text if len(text) <= 60 else text[:57] + "..."


def bos_count(tokenizer: Any) -> int | None:
    """How many BOS tokens open a chat-rendered message tokenized with add_special_tokens=True; None
    when the tokenizer has no BOS or no chat template."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or not getattr(tokenizer, "chat_template", None):
        return None
    text = tokenizer.apply_chat_template(PROBE_MESSAGE, tokenize=False, add_generation_prompt=True)
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    count = 0
    while count < len(ids) and ids[count] == bos:
        count += 1
    return count


def check_double_bos(tokenizer: Any, side: str) -> list[Finding]:
    """A finding when the chat template writes BOS and the tokenizer adds another (module docstring)."""
    count = bos_count(tokenizer)
    if count is None or count < 2:
        return []
    bos = tokenizer.bos_token
    values = {"trainer": None, "engine": None, side: f"{count} x {bos}"}
    return [Finding(
        "double_bos", "warn", values["trainer"], values["engine"],
        f"the {side}'s chat template writes {bos} and its tokenizer adds it again: text rendered with the "
        f"template, then tokenized with add_special_tokens=True, opens with {bos} {count} times, while "
        "apply_chat_template(tokenize=True) opens with it once.",
        "Tokenize rendered chat text with add_special_tokens=False (or tokenize in apply_chat_template), "
        "on both sides.")]


def check_tokenizer_size(tokenizer: Any, config: dict[str, Any] | None, side: str) -> list[Finding]:
    """A finding when the tokenizer has ids past the model's embedding rows."""
    vocab = (config or {}).get("vocab_size")
    if vocab is None or len(tokenizer) <= int(vocab):
        return []
    values = {"trainer": None, "engine": None, side: f"tokenizer {len(tokenizer)} > vocab_size {vocab}"}
    return [Finding(
        "tokenizer_size", "critical", values["trainer"], values["engine"],
        f"the {side}'s tokenizer has ids past the model's {vocab} embedding rows: such a token has no logprob.",
        "Use the tokenizer the model was trained with, or resize the model's embeddings to the tokenizer.")]
