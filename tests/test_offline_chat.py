"""The offline API as vLLM's scripts call it: `LLM.chat` with tools, a chat template of the
call's own and template variables; `TextPrompt` / `TokensPrompt`; `use_tqdm`."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams, TextPrompt, TokensPrompt

pytestmark = pytest.mark.slow

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
# Renders what the test looks for: every tool's name, a template variable, then the turns.
TEMPLATE = (
    "{% for tool in tools or [] %}[tool {{ tool.function.name }}]{% endfor %}"
    "{% if style %}[style {{ style }}]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=512)


def prompt_text(llm: LLM, output) -> str:
    return llm.get_tokenizer().decode(output.prompt_token_ids, skip_special_tokens=False)


def test_chat_renders_tools_and_template_kwargs_through_the_calls_template(llm):
    (out,) = llm.chat(
        WEATHER,
        ONE_TOKEN,
        chat_template=TEMPLATE,
        chat_template_kwargs={"style": "brief"},
        tools=TOOLS,
    )
    text = prompt_text(llm, out)
    assert text.startswith("[tool get_weather][style brief]<|im_start|>user\nWeather in Paris?")
    assert text.endswith("<|im_start|>assistant\n")
    assert len(out.outputs[0].token_ids) == 1
    bare = llm.chat(WEATHER, ONE_TOKEN, chat_template=TEMPLATE)[0]
    assert prompt_text(llm, bare).startswith("<|im_start|>user")  # no tools, no variable


def test_without_a_template_of_its_own_chat_renders_the_models(llm):
    tokenizer = llm.get_tokenizer()
    (out,) = llm.chat(WEATHER, ONE_TOKEN, chat_template_kwargs={"unused_variable": 1})
    assert out.prompt_token_ids == tokenizer.encode_chat(WEATHER)
    without = llm.chat(WEATHER, ONE_TOKEN, add_generation_prompt=False)[0]
    assert not prompt_text(llm, without).endswith("<|im_start|>assistant\n")


def test_chat_template_kwargs_may_not_replace_the_renderers_own(llm):
    with pytest.raises(ValueError, match="'tools'"):
        llm.chat(WEATHER, ONE_TOKEN, chat_template_kwargs={"tools": []})


def test_text_and_tokens_prompts_are_generated_as_their_plain_forms(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The capital of France is")
    text, tokens, plain = llm.generate(
        [
            TextPrompt(prompt="The capital of France is"),
            TokensPrompt(prompt_token_ids=ids, prompt="shown only"),
            "The capital of France is",
        ],
        SamplingParams(temperature=0, max_tokens=4),
    )
    assert text.prompt_token_ids == tokens.prompt_token_ids == plain.prompt_token_ids == ids
    assert tokens.prompt == "shown only" and text.prompt == "The capital of France is"
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_prompt_dict_with_a_key_ember_cannot_honour_is_refused(llm):
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": "Hi", "multi_modal_data": {"image": None}}, ONE_TOKEN)


class CountingBar:
    """A tqdm-like bar that records what the API tells it."""

    def __init__(self, total: int, **kwargs) -> None:
        self.total, self.count, self.closed = total, 0, False

    def update(self, n: int) -> None:
        self.count += n

    def close(self) -> None:
        self.closed = True


def test_use_tqdm_counts_each_prompt_once_all_its_choices_are_done(llm):
    made: list[CountingBar] = []

    def factory(**kwargs) -> CountingBar:
        made.append(CountingBar(**kwargs))
        return made[-1]

    params = SamplingParams(temperature=0.8, max_tokens=2, n=3, seed=1)
    llm.generate(["a", "b"], params, use_tqdm=factory)
    llm.chat([WEATHER, WEATHER, WEATHER], ONE_TOKEN, use_tqdm=factory)
    llm.generate(["a"], ONE_TOKEN)  # off by default: no bar
    assert [(bar.total, bar.count, bar.closed) for bar in made] == [(2, 2, True), (3, 3, True)]


def test_use_tqdm_true_draws_a_bar_on_stderr(llm, capsys):
    llm.generate(["a", "b"], ONE_TOKEN, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    llm.generate(["a", "b"], ONE_TOKEN)
    assert "Processed prompts" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def think_llm(tmp_path_factory) -> LLM:
    from helpers.think import make_think_model

    path = make_think_model(tmp_path_factory.mktemp("think"))
    return LLM(str(path), max_model_len=256, reasoning_parser="deepseek_r1")


def test_chat_splits_a_reasoning_models_reply(think_llm):
    close = think_llm.get_tokenizer().added_token_id("</think>")
    # deepseek_r1: the reply is reasoning until </think> (a random model never writes it).
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (whole,) = think_llm.chat(WEATHER, params)
    completion = whole.outputs[0]
    assert completion.reasoning_content == completion.text.strip()
    assert completion.content is None
    # Pushed to write </think> first: no reasoning, the rest is the answer.
    closed = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={close: 50})
    (split,) = think_llm.chat(WEATHER, closed)
    completion = split.outputs[0]
    assert completion.text.startswith("</think>")
    assert completion.reasoning_content is None
    assert completion.content == completion.text.removeprefix("</think>").lstrip()


def test_without_a_reasoning_parser_chat_reads_no_reasoning(llm):
    (out,) = llm.chat(WEATHER, ONE_TOKEN)
    assert out.outputs[0].reasoning_content is None and out.outputs[0].content is None


def test_an_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser 'granite'"):
        LLM(max_model_len=64, reasoning_parser="granite")
