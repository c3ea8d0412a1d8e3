"""The deepseek-r1 reasoning parser: text before </think> is reasoning, after it the answer;
prefixes never take back what they gave; reasoning tokens are counted up to the tag."""

from matrixinfer.tokenizer import Tokenizer
from matrixinfer.serving.reasoning import reasoning_tokens, split_reasoning

TEXT = "<think>\nLet me think: 2 + 2.\n</think>\n\nIt is 4."


def test_split_with_and_without_opening_tag():
    """The opening <think> is optional (R1's template may put it in the prompt)."""
    for text in (TEXT, TEXT[len("<think>"):]):
        s = split_reasoning(text, final=True)
        assert s.reasoning == "\nLet me think: 2 + 2.\n" and s.content == "\n\nIt is 4."


def test_unclosed_thinking_is_all_reasoning():
    """A model cut off while thinking has reasoning and no content."""
    s = split_reasoning("<think>still going", final=True)
    assert s.reasoning == "still going" and s.content is None


def test_prefixes_only_ever_extend():
    """Streaming: each prefix's split extends the previous one's; tags are never sent."""
    prev_r, prev_c = "", ""
    for i in range(len(TEXT) + 1):
        s = split_reasoning(TEXT[:i], final=i == len(TEXT))
        assert s.reasoning.startswith(prev_r) and (s.content or "").startswith(prev_c)
        assert "think>" not in s.reasoning and "think>" not in (s.content or "")
        prev_r, prev_c = s.reasoning, s.content or ""
    assert (prev_r, prev_c) == ("\nLet me think: 2 + 2.\n", "\n\nIt is 4.")


def test_reasoning_tokens_count_up_to_the_closing_tag(text_checkpoint):
    """Tokens up to the one completing </think> are reasoning; with no tag all are."""
    tok = Tokenizer(text_checkpoint[0])
    think = tok.encode("<think>ab</think>", add_special_tokens=False)
    answer = tok.encode("cd", add_special_tokens=False)
    assert reasoning_tokens(think + answer, tok) == len(think)
    assert reasoning_tokens(answer, tok) == len(answer)
