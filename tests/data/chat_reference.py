#!/usr/bin/env python3
"""Writes tests/data/chat_conversations.smollm2.json: HF transformers' ids and assistant masks of the
conversations in tests/data/chat_conversations.jsonl with SmolLM2-135M-Instruct's tokenizer, which
`chunkwise tokenize --chat-jsonl` must reproduce exactly (tests/tools/test_data.cpp).

    python3 tests/data/chat_reference.py .models/smollm2

The directory is the tokenizer exported from the model's GGUF (tests/data/README.md says how).
Needs: pip install transformers tokenizers jinja2 (no torch).

What is marked. SmolLM2's chat template has no {% generation %} block, so HF's
apply_chat_template(..., return_assistant_tokens_mask=True) marks no token at all with it. The
reference therefore renders with the same template rewritten so that each assistant message's
content and its closing <|im_end|> lie inside {% generation %} ... {% endgeneration %} (the
"<|im_start|>assistant\\n" before it and the "\\n" after it do not): the rendered text, and so the
ids, are asserted to be the same as the original template's, and only the mask is new. HF marks
every token from the one holding the span's first character to the one holding its last (a token
that straddles the span's edge is marked).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONVERSATIONS = os.path.join(HERE, "chat_conversations.jsonl")
OUT = os.path.join(HERE, "chat_conversations.smollm2.json")

# The message part of SmolLM2's template (its newlines are in the Jinja literals as they are), and the same with the assistant's reply in a generation block.
TURN = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
TURN_WITH_GENERATION = (
    "{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    import transformers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    template = tokenizer.chat_template
    if template.count(TURN) != 1:
        sys.exit(f"the tokenizer's chat template is not SmolLM2's (no single {TURN!r} in it)")
    generation_template = template.replace(TURN, TURN_WITH_GENERATION)

    conversations = []
    with open(CONVERSATIONS, encoding="utf-8") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            plain = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
            out = tokenizer.apply_chat_template(messages, chat_template=generation_template, tokenize=True,
                                                return_assistant_tokens_mask=True, return_dict=True)
            assert tokenizer.apply_chat_template(messages, chat_template=generation_template, tokenize=False) == text
            assert list(out["input_ids"]) == list(plain), "the generation blocks changed the ids"
            conversations.append({"text": text, "ids": list(out["input_ids"]),
                                  "assistant_mask": list(out["assistant_masks"])})

    with open(OUT, "w", encoding="utf-8") as f:
        json.dump({"source": f"transformers {transformers.__version__} apply_chat_template(tokenize=True, "
                             f"return_assistant_tokens_mask=True), SmolLM2-135M-Instruct's template with the "
                             f"assistant's content and <|im_end|> in a generation block (see chat_reference.py)",
                   "conversations": conversations}, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(conversations)} conversations")


if __name__ == "__main__":
    main()
