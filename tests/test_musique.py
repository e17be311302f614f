"""The MuSiQue loader on hand-written rows in the official format, the synthetic multi-hop set, and the
retrieval QA environment end to end with a scripted model (figures by hand)."""

import json

import pytest

from megareason.config import load_config
from megareason.config.schema import Config, EnvConfig
from megareason.data.loaders import load_records
from megareason.data.musique import documents_of, load_musique
from megareason.data.records import DataError, Document, PromptRecord
from megareason.data.synthetic_multihop import synthetic_multihop
from megareason.envs.retrieval_qa import RetrievalQAEnv
from megareason.envs.rollout import run_episodes
from megareason.models.tiny import build_tokenizer
from megareason.rewards import compute_score
from megareason.rollout.records import Completion, Sampling
from megareason.settings import retrieval_qa_settings
from megareason.trainer.experience import build_experience


def row(**changes):
    r = {
        "id": "2hop__1_2", "question": "Who founded the company where Ada Vell works?", "answer": "Bo Lind",
        "answer_aliases": ["B. Lind"], "answerable": True,
        "paragraphs": [
            {"idx": 0, "title": "Ada Vell", "paragraph_text": "Ada Vell works at Quorel Labs.", "is_supporting": True},
            {"idx": 1, "title": "Paris", "paragraph_text": "Paris is in France.", "is_supporting": False},
            {"idx": 2, "title": "Quorel Labs", "paragraph_text": "Quorel Labs was founded by Bo Lind.",
             "is_supporting": True},
        ],
        "question_decomposition": [
            {"id": 1, "question": "Where does Ada Vell work?", "answer": "Quorel Labs", "paragraph_support_idx": 0},
            {"id": 2, "question": "Who founded #1?", "answer": "Bo Lind", "paragraph_support_idx": 2},
        ],
    }
    r.update(changes)
    return r


def write(tmp_path, *rows, name="musique.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_loader_reads_the_official_format(tmp_path):
    path = write(tmp_path, row(), row(id="x", answerable=False), row(id="3hop", question="Q3?"))
    recs = load_musique(path)
    assert [r.extra_info["id"] for r in recs] == ["2hop__1_2", "3hop"]  # the unanswerable row is skipped
    rec = recs[0]
    assert rec.prompt == [{"role": "user", "content": "Who founded the company where Ada Vell works?"}]
    assert (rec.data_source, rec.ground_truth) == ("musique", "Bo Lind")
    e = rec.extra_info
    assert (e["hops"], e["supporting_ids"], e["answer_aliases"]) == (2, ["0", "2"], ["B. Lind"])
    assert documents_of(rec) == [Document("0", "Ada Vell", "Ada Vell works at Quorel Labs.", True),
                                 Document("1", "Paris", "Paris is in France.", False),
                                 Document("2", "Quorel Labs", "Quorel Labs was founded by Bo Lind.", True)]
    assert json.loads(json.dumps(e)) == e  # JSON-safe
    assert e["decomposition"][1] == {"question": "Who founded #1?", "answer": "Bo Lind", "paragraph_support_idx": 2}
    assert len(load_musique(path, answerable_only=False)) == 3


def _paragraph(**changes):
    p = {"idx": 5, "title": "T", "paragraph_text": "x", "is_supporting": False}
    p.update(changes)
    return p


@pytest.mark.parametrize("bad, message", [
    ("{not json", "row 2: not valid JSON"),
    ("[1, 2]", "row 2: expected a JSON object, got list"),
    (row(question=None), "row 2: field 'question' must be a string, got null"),
    ({k: v for k, v in row().items() if k != "id"}, "row 2: missing field 'id'"),
    (row(answerable="yes"), "row 2: field 'answerable' must be true or false"),
    ({k: v for k, v in row().items() if k != "answer"}, "row 2: missing field 'answer'"),
    (row(answer_aliases="B. Lind"), "row 2: field 'answer_aliases' must be a list of strings"),
    (row(paragraphs=[]), "row 2: field 'paragraphs' must be a non-empty list"),
    (row(paragraphs=[_paragraph(), _paragraph()]), "row 2 paragraphs[1]: duplicate paragraph idx 5"),
    (row(paragraphs=[_paragraph(idx="5")]), "row 2 paragraphs[0]: field 'idx' must be an integer"),
    (row(paragraphs=[_paragraph(idx=True)]), "row 2 paragraphs[0]: field 'idx' must be an integer"),
    (row(paragraphs=[{"idx": 5, "title": "T"}]), "row 2 paragraphs[0]: missing field 'paragraph_text'"),
    (row(paragraphs=[_paragraph(is_supporting="no")]), "row 2 paragraphs[0]: field 'is_supporting' must be true or"),
    (row(paragraphs=[_paragraph(idx=1)], question_decomposition=[
        {"question": "q", "answer": "a", "paragraph_support_idx": True}]),
     "row 2 question_decomposition[0]: paragraph_support_idx true is not the idx"),
    (row(question_decomposition=[{"question": "q", "answer": "a", "paragraph_support_idx": 9}]),
     "row 2 question_decomposition[0]: paragraph_support_idx 9 is not the idx of one of the row's paragraphs"),
    (row(question_decomposition=[]), "row 2: field 'question_decomposition' must be a non-empty list"),
])
def test_loader_errors_name_file_row_and_field(tmp_path, bad, message):
    path = write(tmp_path, row(), bad)
    with pytest.raises(DataError) as e:
        load_musique(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value)


def test_documents_of_rejects_records_without_documents():
    with pytest.raises(DataError, match=r"row 7: extra_info\['documents'\] must be a non-empty list"):
        documents_of(PromptRecord(prompt=[], data_source="musique", ground_truth="a"), "row 7")
    with pytest.raises(DataError, match=r"extra_info\['documents'\]\[0\] must be an object with 'id' and 'text'"):
        documents_of(PromptRecord(prompt=[], data_source="musique", ground_truth="a",
                                  extra_info={"documents": [{"id": "1"}]}))


def test_loader_missing_file_and_no_rows(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_musique(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no answerable rows"):
        load_musique(write(tmp_path, row(answerable=False)))


def test_synthetic_set_is_deterministic_and_its_chains_hold():
    a, b = synthetic_multihop(30, seed=3), synthetic_multihop(30, seed=3)
    assert [r.extra_info for r in a] == [r.extra_info for r in b]
    assert [r.extra_info["hops"] for r in a[:4]] == [2, 3, 2, 3]
    assert synthetic_multihop(30, seed=4)[0].extra_info != a[0].extra_info or \
        synthetic_multihop(30, seed=4)[1].extra_info != a[1].extra_info
    for r in a:
        e = r.extra_info
        docs = {d["id"]: d for d in e["documents"]}
        steps = e["decomposition"]
        assert len(steps) == e["hops"] == len(e["supporting_ids"]) and len(docs) == e["hops"] + 6
        for step in steps:  # each hop's answer is stated in its supporting paragraph
            assert step["answer"] in docs[str(step["paragraph_support_idx"])]["text"]
            assert docs[str(step["paragraph_support_idx"])]["supporting"]
        assert steps[-1]["answer"] == r.ground_truth in docs[str(steps[-1]["paragraph_support_idx"])]["text"]
        assert r.data_source == "musique" and r.prompt == [{"role": "user", "content": e["question"]}]
        assert compute_score("musique", f"<answer>{r.ground_truth}</answer>", r.ground_truth, e).score == 1.0
        assert [d.id for d in documents_of(r)] == [str(j) for j in range(len(docs))]
        for prev, step in zip(steps, steps[1:], strict=False):  # the chain: a hop's answer names the next entity
            assert prev["answer"] in step["question"]
    with pytest.raises(ValueError, match="hops must be"):
        synthetic_multihop(2, hops=(4,))
    with pytest.raises(ValueError, match="distractors must be"):
        synthetic_multihop(2, distractors=1000)


def test_config_kinds_load_records(tmp_path):
    path = write(tmp_path, row())
    cfg = load_config("eval_multihop", [f"data.sources=[{{kind: musique, path: {path}}}, "
                                        "{kind: synthetic_multihop, size: 3, seed: 1, options: {hops: [3]}}]"])
    recs = load_records(cfg.data)
    assert [r.extra_info["hops"] for r in recs] == [2, 3, 3, 3]
    assert [r.extra_info["index"] for r in recs] == [0, 1, 2, 3]
    with pytest.raises(Exception, match="path"):
        load_config("eval_multihop", ["data.sources=[{kind: musique}]"])
    bad = load_config("eval_multihop", ["data.sources=[{kind: synthetic_multihop, size: 2, options: {hop: 2}}]"])
    with pytest.raises(DataError, match="unknown options \\['hop'\\]"):
        load_records(bad.data)


class Script:
    def __init__(self, tok, messages):
        self.tok, self.messages = tok, list(messages)

    def __call__(self, contexts, sampling):
        out = []
        for _ in contexts:
            text = self.messages.pop(0)
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append([Completion(token_ids=ids, text=text, logprobs_T=[-1.0] * len(ids), finish_reason="stop")])
        return out


def test_retrieval_qa_episode_end_to_end(tmp_path):
    tok = build_tokenizer()
    [rec] = load_musique(write(tmp_path, row()))
    env = RetrievalQAEnv(rec, retrieval_qa_settings(Config(env=EnvConfig(retriever="bm25", top_k=1))))
    call = '<tool_call>{"name": "search", "arguments": {"query": "Ada Vell works"}}</tool_call>'
    bad = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    answer = "Quorel Labs was founded by Bo Lind [2] [0] [7]. <answer>Bo Lind</answer>"
    [ep] = run_episodes([env], Script(tok, [call, bad, answer]), tok, Sampling(), max_turns=4, max_model_len=2048)
    assert ep.end == "done" and ep.turns == 3
    assert ep.messages[0]["content"].startswith("Answer the user's question from the documents.")  # env's prompt
    assert ep.messages[3] == {"role": "tool", "content": "[0] Ada Vell\nAda Vell works at Quorel Labs."}
    assert ep.messages[5]["content"] == "Error: unknown tool 'lookup'; available: search"
    info = ep.result.info
    # retrieved {0} of supporting {0, 2}: reward (EM 1 + F1 1) / 2 + 0.5 * 1/2 (multihop_qa defaults, MuSiQue RLVR's)
    assert ep.result.reward == 1.25 and ep.result.correct
    assert (info["em"], info["f1"], info["retrieval_recall"], info["retrieval_precision"]) == (1.0, 1.0, 0.5, 1.0)
    assert info["cited_ids"] == ["2", "0"] and info["citation_recall"] == 1.0  # [7] is not a document
    assert (info["searches"], info["tool_errors"], info["queries"]) == (1, 1, ["Ada Vell works"])
    exp = build_experience([type("P", (), {"token_ids": ep.prompt_ids})()], [[ep.completion]])
    assert int(exp.mask_BT.sum()) == sum(len(tok.encode(m, add_special_tokens=False)) + 1 for m in [call, bad, answer])


def test_retrieval_qa_turn_limit_scores_the_last_message():
    tok = build_tokenizer()
    [rec] = synthetic_multihop(1, seed=0, hops=(2,))
    env = RetrievalQAEnv(rec, retrieval_qa_settings(Config(env=EnvConfig(retriever="golden", top_k=5))))
    call = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    [ep] = run_episodes([env], Script(tok, [call]), tok, Sampling(), max_turns=1, max_model_len=2048)
    assert ep.end == "turn_limit" and not ep.result.correct
    assert ep.result.info["retrieval_recall"] == 1.0  # golden showed both supporting paragraphs
    assert ep.result.reward == 0.5  # no answer: (0 + 0) / 2 + 0.5 * recall 1
    with pytest.raises(ValueError, match="extra_info\\['documents'\\]"):
        RetrievalQAEnv(type(rec)(prompt=rec.prompt, data_source="musique", ground_truth="a", extra_info={}),
                       env.settings)


def test_initial_search_opens_the_episode_in_the_prompt():
    tok = build_tokenizer()
    [rec] = synthetic_multihop(1, seed=0, hops=(2,))
    settings = retrieval_qa_settings(Config(env=EnvConfig(retriever="golden", top_k=2, initial_search=True)))
    env = RetrievalQAEnv(rec, settings)
    [ep] = run_episodes([env], Script(tok, ["<answer>x</answer>"]), tok, Sampling(), max_turns=2, max_model_len=4096)
    question = rec.prompt[-1]["content"]
    info = ep.result.info
    supporting = sorted(rec.extra_info["supporting_ids"])
    # the opening search showed both supporting paragraphs, but the model retrieved nothing itself
    assert env.queries == [question] and sorted(info["opening_ids"]) == supporting
    assert info["retrieved_ids"] == info["opening_ids"] and info["model_retrieved_ids"] == []
    assert info["retrieval_recall"] == 0.0 and ep.result.reward == 0.0  # EM 0, F1 0, recall 0
    prompt = tok.decode(ep.prompt_ids, skip_special_tokens=False)
    call = json.dumps({"name": "search", "arguments": {"query": question}})
    assert f"<|im_start|>assistant\n<tool_call>{call}</tool_call><|im_end|>\n<|im_start|>tool\n[" in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ep.completion.mask_T == [1] * len(ep.completion.token_ids)  # the opening search is prompt, not trained


def test_with_initial_search_only_the_models_own_searches_count_as_retrieved():
    tok = build_tokenizer()
    [rec] = synthetic_multihop(1, seed=0, hops=(2,))
    settings = retrieval_qa_settings(Config(env=EnvConfig(retriever="golden", top_k=1, initial_search=True)))
    env = RetrievalQAEnv(rec, settings)
    call = '<tool_call>{"name": "search", "arguments": {"query": "anything"}}</tool_call>'
    answer = f"<answer>{rec.ground_truth}</answer>"
    [ep] = run_episodes([env], Script(tok, [call, answer]), tok, Sampling(), max_turns=3, max_model_len=4096)
    info = ep.result.info
    # golden, top 1: the opening search and the model's own search both return the first supporting paragraph
    assert info["opening_ids"] == info["model_retrieved_ids"] == info["retrieved_ids"] == info["retrieved_ids"][:1]
    assert info["searches"] == 2 and info["retrieval_recall"] == 0.5  # 1 of the 2 supporting paragraphs
    assert ep.result.reward == 1.25 and ep.result.correct  # (1 + 1) / 2 + 0.5 * 1/2
    # the same episode without the model's search: the opening's paragraph is not paid for
    env = RetrievalQAEnv(rec, settings)
    [ep] = run_episodes([env], Script(tok, [answer]), tok, Sampling(), max_turns=3, max_model_len=4096)
    assert ep.result.info["retrieval_recall"] == 0.0 and ep.result.reward == 1.0
