"""Tool calls, the multi-turn rollout's token layout and loss mask, against the chat template's own rendering."""

import json

import pytest
import torch

from megareason.envs.base import StepResult
from megareason.envs.rollout import ChatFormat, run_episodes
from megareason.envs.tools import ToolCall, call_tool, describe_tools, parse_tool_calls, tool_schema
from megareason.models.tiny import build_tokenizer
from megareason.rollout.records import Completion, Sampling
from megareason.trainer.experience import build_experience, pack_experience, prompt_lengths


def lookup(city: str, year: int = 2020) -> str:
    """Look up a city's population.

    Args:
        city: the city's name
        year: the census year
    """
    if city == "boom":
        raise RuntimeError("database down")
    return f"{city}: 1000 in {year}"


# --- parsing and calling -----------------------------------------------------


def test_parse_valid_calls_in_order():
    text = ('I will look. <tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call> and '
            '<tool_call>\n{"name": "lookup", "arguments": "{\\"city\\": \\"Rome\\", \\"year\\": 1990}"}\n</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("lookup", {"city": "Oslo"}),
                                      ToolCall("lookup", {"city": "Rome", "year": 1990})]
    assert parse_tool_calls("no call here <answer>4</answer>") == []
    # generation stopped before the closing tag: the JSON is complete, so the call stands
    assert parse_tool_calls('<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}') == [
        ToolCall("lookup", {"city": "Oslo"})]


@pytest.mark.parametrize("body, error", [
    ('{"name": "lookup", "arguments": {"city": "Oslo"', "not JSON"),
    ('["lookup"]', "expected {"),
    ('{"arguments": {}}', "expected {"),
    ('{"name": "lookup", "arguments": [1]}', "arguments must be a JSON object"),
])
def test_parse_malformed_calls_become_errors(body, error):
    [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert error in call.error
    assert call_tool(call, {"lookup": lookup}).startswith("Error: malformed tool call")


def test_call_tool_results_and_errors():
    tools = {"lookup": lookup}
    assert call_tool(ToolCall("lookup", {"city": "Oslo", "year": 1990}), tools) == "Oslo: 1000 in 1990"
    assert call_tool(ToolCall("search", {"q": "x"}), tools) == "Error: unknown tool 'search'; available: lookup"
    assert call_tool(ToolCall("lookup", {"town": "Oslo"}), tools).startswith("Error: bad arguments for lookup:")
    assert call_tool(ToolCall("lookup", {}), tools).startswith("Error: bad arguments for lookup:")
    assert call_tool(ToolCall("lookup", {"city": "boom"}), tools) == \
        "Error: lookup failed: RuntimeError: database down"


def test_tool_schema_from_signature_and_docstring():
    fn = tool_schema(lookup)["function"]
    assert fn["name"] == "lookup" and fn["description"] == "Look up a city's population."
    assert fn["parameters"]["properties"] == {"city": {"type": "string", "description": "the city's name"},
                                              "year": {"type": "integer", "description": "the census year"}}
    assert fn["parameters"]["required"] == ["city"]
    assert json.dumps(fn) in describe_tools([lookup])


# --- the multi-turn rollout ------------------------------------------------------


class ScriptedEnv:
    """Plays back the environment side: a tool result for every message with a call, else done."""

    def __init__(self, question="How many people live in Oslo?"):
        self.tools = [lookup]
        self.question, self.seen, self.finished = question, [], False

    def reset(self):
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": self.question}]

    def step(self, message):
        self.seen.append(message)
        calls = parse_tool_calls(message)
        if not calls:
            return StepResult(reward=1.0, done=True, correct=True)
        return StepResult(observation=call_tool(calls[0], {"lookup": lookup}))

    def finish(self):
        self.finished = True
        return StepResult(reward=-1.0, done=True)


class ScriptedModel:
    """A generate function replaying messages (each ends with EOS, as vLLM returns them); records contexts."""

    def __init__(self, tok, messages, eos=True):
        self.tok, self.messages, self.eos, self.contexts, self.samplings = tok, list(messages), eos, [], []

    def __call__(self, contexts, sampling):
        self.samplings.append(sampling)
        out = []
        for ctx in contexts:
            self.contexts.append(list(ctx))
            text = self.messages.pop(0)
            ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if self.eos else [])
            out.append([Completion(token_ids=ids, text=text, logprobs_T=[-0.5] * len(ids), finish_reason="stop")])
        return out


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


CALL = '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'


def test_episode_tokens_are_the_chat_templates_rendering_and_mask_only_the_model(tok):
    env, model = ScriptedEnv(), ScriptedModel(tok, [CALL, "It is 1000. <answer>1000</answer>"])
    [ep] = run_episodes([env], model, tok, Sampling(max_tokens=64), max_turns=4, max_model_len=1024)
    assert ep.end == "done" and ep.turns == 2 and ep.result.reward == 1.0
    assert env.seen == [CALL, "It is 1000. <answer>1000</answer>"]
    # Independent check: the whole sequence decodes to the template's rendering of the transcript
    # (system prompt + tool descriptions, the two assistant messages and the tool message).
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert ep.messages[3]["content"] == "Oslo: 1000 in 2020"
    rendered = tok.apply_chat_template([{"role": "system", "content": "Be brief.\n\n" + describe_tools([lookup])},
                                        *ep.messages[1:]], tokenize=False)
    ids = ep.prompt_ids + ep.completion.token_ids
    assert tok.decode(ids, skip_special_tokens=False) == rendered.rstrip("\n")
    # The model saw exactly the growing sequence: prompt, then prompt + its message + the observation.
    assert model.contexts[0] == ep.prompt_ids
    first = tok.encode(CALL, add_special_tokens=False) + [tok.eos_token_id]
    obs_text = "\n<|im_start|>tool\nOslo: 1000 in 2020<|im_end|>\n<|im_start|>assistant\n"
    obs = tok.encode(obs_text, add_special_tokens=False)
    assert model.contexts[1] == ep.prompt_ids + first + obs
    # Loss mask and log-probs: 1 / -0.5 on the model's tokens, 0 / 0 on the observation's.
    second = len(ep.completion.token_ids) - len(first) - len(obs)
    assert ep.completion.mask_T == [1] * len(first) + [0] * len(obs) + [1] * second
    assert ep.completion.logprobs_T == [-0.5] * len(first) + [0.0] * len(obs) + [-0.5] * second


def test_multi_turn_experience_masks_observations_and_packs_with_the_prompt_shared(tok):
    envs = [ScriptedEnv(), ScriptedEnv()]
    model = ScriptedModel(tok, [CALL, "<answer>9</answer>", "<answer>1000</answer>"])
    eps = run_episodes(envs, model, tok, Sampling(max_tokens=64), max_turns=3, max_model_len=1024)
    prompt = eps[0].prompt_ids
    exp = build_experience([type("P", (), {"token_ids": prompt})()], [[e.completion for e in eps]])
    for b, ep in enumerate(eps):
        row = exp.mask_BT[b, len(prompt):len(prompt) + len(ep.completion.token_ids)]
        assert row.tolist() == ep.completion.mask_T
    assert prompt_lengths(exp.mask_BT, exp.lengths_B).tolist() == [len(prompt)] * 2  # not the count of 1s
    [mb] = pack_experience(exp, 4096, ["mask_BT"], share_prefix=True)
    assert mb.shared is not None  # the two episodes share the prompt
    assert int(mb.fields["mask_BT"].sum()) == int(exp.mask_BT.sum())


def test_turn_limit_and_context_limit_end_episodes_through_finish(tok):
    env = ScriptedEnv()
    [ep] = run_episodes([env], ScriptedModel(tok, [CALL, CALL]), tok, Sampling(max_tokens=64), max_turns=2,
                        max_model_len=1024)
    assert (ep.end, ep.turns, ep.result.reward, env.finished) == ("turn_limit", 2, -1.0, True)
    assert ep.completion.mask_T[-1] == 1  # the last message's observation was never appended
    prompt_len = len(ChatFormat(tok, [lookup]).prompt_ids(ScriptedEnv().reset()))
    env = ScriptedEnv()
    model = ScriptedModel(tok, [CALL])
    [ep] = run_episodes([env], model, tok, Sampling(max_tokens=64), max_turns=4, max_model_len=prompt_len + 60)
    assert (ep.end, ep.turns, env.finished) == ("context_limit", 1, True)
    assert model.samplings[0].max_tokens == 60  # the message may fill what the context has left
    with pytest.raises(ValueError, match="no room"):
        run_episodes([ScriptedEnv()], model, tok, Sampling(), max_turns=1, max_model_len=prompt_len)


def test_seeded_turns_draw_distinct_seeds(tok):
    model = ScriptedModel(tok, [CALL, "<answer>1</answer>"])
    run_episodes([ScriptedEnv()], model, tok, Sampling(seed=7, n=4, max_tokens=32), max_turns=3, max_model_len=1024)
    assert [s.n for s in model.samplings] == [1, 1]
    assert model.samplings[0].seed == 7 and model.samplings[1].seed != 7


def test_template_without_a_tool_role_gets_results_as_user_messages(tok):
    strict = build_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fmt = ChatFormat(strict, [lookup])
    assert fmt.tool_role == "user" and not fmt.native_tools
    ids = fmt.observation_ids(strict.encode("x", add_special_tokens=False) + [strict.eos_token_id], "R")
    assert strict.decode(ids, skip_special_tokens=False) == \
        "\n<|im_start|>user\n<tool_response>\nR\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # a message that stopped without EOS gets the whole end-of-turn marker
    ids = fmt.observation_ids(strict.encode("x", add_special_tokens=False), "R")
    assert strict.decode(ids, skip_special_tokens=False).startswith("<|im_end|>\n<|im_start|>user")
    assert torch.tensor(ids).dtype == torch.int64
