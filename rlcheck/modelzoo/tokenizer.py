"""The tiny byte-level BPE tokenizer: trained with `tokenizers` on the generated corpus, saved as a
Hugging Face fast tokenizer (tokenizer.json, tokenizer_config.json, chat template) that
`AutoTokenizer.from_pretrained` and vLLM both load. Digits are single tokens (arithmetic task)."""

from __future__ import annotations

from pathlib import Path

from rlcheck.errors import ConfigError
from rlcheck.modelzoo.corpus import corpus

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (BOS, EOS, PAD) + tuple(f"<|{role}|>" for role in ROLES)
# One turn: "<|role|>\ncontent<|eos|>\n"; the prompt opens with BOS and ends with "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` with exactly `vocab_size` entries (specials first: BOS=0, EOS=1, PAD=2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def save_tokenizer(vocab_size: int, max_length: int, out_dir: Path, **special: str):
    """Train the tokenizer, save it into `out_dir` and return it (a `PreTrainedTokenizerFast`);
    `max_length`: the model's context length, for the tokenizer's `model_max_length`; `special`: more
    special-token names (`unk_token=...`)."""
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise ConfigError(
            f"the tokenizer corpus yields only {tok.get_vocab_size()} tokens, not vocab_size={vocab_size}; "
            "ask for a smaller vocab_size"
        )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        **special,
    )
    hf_tok.save_pretrained(out_dir)
    return hf_tok
