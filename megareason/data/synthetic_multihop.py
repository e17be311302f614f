"""A built-in, offline multi-hop QA set in MuSiQue's record format (``data.musique``).

A small knowledge base of fictional people, companies, cities and countries (invented names, so a
model cannot answer from memory) is written out as one short paragraph per entity. Questions chain
two or three facts, e.g. "In which country was the founder of Quorel Labs born?" needs the company's
paragraph (its founder), the founder's (birthplace) and the city's (country). Each question's corpus
is its supporting paragraphs plus ``distractors`` other paragraphs of the same knowledge base,
shuffled. The knowledge base is fixed; ``seed`` picks the questions and the distractors.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from megareason.data.records import PromptRecord

_FIRST = ["Orvan", "Selka", "Tamsin", "Idris", "Mireva", "Calder", "Ysolde", "Brannoc", "Elowen", "Corvin",
          "Nerys", "Halvard", "Sabeth", "Joruun", "Fenna", "Alaric", "Wenna", "Dariel", "Ilsabet", "Oswin"]
_LAST = ["Telluse", "Marrowby", "Quenfold", "Astrane", "Vellacott", "Brisk", "Dunmore", "Ferrow", "Galloway",
         "Hestrel", "Ivers", "Jastrow", "Kellan", "Lunde", "Morrick", "Norcroft", "Orrin", "Pellow", "Ruske",
         "Strand"]
_CITIES = ["Varnholt", "Quillmere", "Ostrevane", "Belmarrow", "Tiravel", "Corrowin", "Espenfield", "Drummask",
           "Hollowgate", "Marenport", "Sunhallow", "Kestwick", "Lorvane", "Pyrsham", "Westerlee", "Arrowmere"]
_COUNTRIES = ["Valdoria", "Kestrania", "Orlund", "Mirevia", "Talosse", "Brennish Isles"]
_COMPANIES = ["Quorel Labs", "Helix Forge", "Brightwater Mills", "Nimbus Freight", "Ardent Optics", "Saltmarsh Foods",
              "Cinder Aerospace", "Lumen Textiles", "Ironleaf Games", "Tidewell Energy", "Oakspire Press",
              "Glassway Robotics"]
_JOBS = ["engineer", "painter", "chemist", "composer", "architect", "novelist", "economist", "surgeon"]
_INDUSTRIES = ["software", "steel", "flour", "shipping", "optics", "food", "aerospace", "textile", "games",
               "energy", "publishing", "robotics"]
_FEATURES = ["its old harbour", "a glass cathedral", "salt markets", "clock towers", "river festivals",
             "a mountain railway"]


def _a(word: str) -> str:
    return f"{'an' if word[0] in 'aeiou' else 'a'} {word}"


class KnowledgeBase:
    """The fixed facts: city -> country, person -> birthplace and job, company -> founder, HQ, industry."""

    def __init__(self) -> None:
        rng = random.Random(20261122)
        self.country = {c: _COUNTRIES[i % len(_COUNTRIES)] for i, c in enumerate(_CITIES)}
        names = [f"{f} {last}" for f, last in zip(_FIRST, rng.sample(_LAST, len(_LAST)), strict=True)]
        self.born = {p: rng.choice(_CITIES) for p in names}
        self.job = {p: rng.choice(_JOBS) for p in names}
        founders = rng.sample(names, len(_COMPANIES))
        self.founder = dict(zip(_COMPANIES, founders, strict=True))
        self.hq = {c: rng.choice(_CITIES) for c in _COMPANIES}
        self.industry = dict(zip(_COMPANIES, _INDUSTRIES, strict=True))
        self.feature = {c: rng.choice(_FEATURES) for c in _CITIES}

    def paragraph(self, entity: str) -> tuple[str, str]:
        """(title, text) of the entity's paragraph."""
        if entity in self.country:
            return entity, (f"{entity} is a city in {self.country[entity]}, known for {self.feature[entity]}. "
                            f"It lies in the {['north', 'south', 'east', 'west'][len(entity) % 4]} of the country.")
        if entity in self.born:
            return entity, (f"{entity} is {_a(self.job[entity])}. {entity} was born in {self.born[entity]} and "
                            f"studied abroad before returning to work.")
        return entity, (f"{entity} is {_a(self.industry[entity])} company founded by {self.founder[entity]}. "
                        f"Its headquarters are in {self.hq[entity]}.")

    def entities(self) -> list[str]:
        return [*self.country, *self.born, *self.founder]


def _questions(kb: KnowledgeBase) -> dict[int, list[tuple[str, str, list[tuple[str, str, str]]]]]:
    """By hop count: (question, answer, steps); a step is (sub-question, its answer, supporting entity)."""
    two, three = [], []
    for p, city in kb.born.items():
        two.append((f"In which country was {p} born?", kb.country[city],
                    [(f"Where was {p} born?", city, p), (f"In which country is {city}?", kb.country[city], city)]))
    for co, p in kb.founder.items():
        city = kb.born[p]
        two.append((f"In which city was the founder of {co} born?", city,
                    [(f"Who founded {co}?", p, co), (f"Where was {p} born?", city, p)]))
        two.append((f"In which country are the headquarters of {co}?", kb.country[kb.hq[co]],
                    [(f"Where are the headquarters of {co}?", kb.hq[co], co),
                     (f"In which country is {kb.hq[co]}?", kb.country[kb.hq[co]], kb.hq[co])]))
        three.append((f"In which country was the founder of {co} born?", kb.country[city],
                      [(f"Who founded {co}?", p, co), (f"Where was {p} born?", city, p),
                       (f"In which country is {city}?", kb.country[city], city)]))
    return {2: two, 3: three}


def synthetic_multihop(n: int, seed: int = 0, hops: Sequence[int] = (2, 3), distractors: int = 6) -> list[PromptRecord]:
    """``n`` questions, hop counts drawn in turn from ``hops``, each with its own shuffled corpus."""
    kb = KnowledgeBase()
    pools = _questions(kb)
    bad = [h for h in hops if h not in pools]
    if not hops or bad:
        raise ValueError(f"synthetic_multihop: hops must be a non-empty list of {sorted(pools)}, got {list(hops)}")
    if not 0 <= distractors <= len(kb.entities()) - 3:
        raise ValueError(f"synthetic_multihop: distractors must be in [0, {len(kb.entities()) - 3}], got {distractors}")
    if n < 1:
        raise ValueError(f"synthetic_multihop: size must be >= 1, got {n}")
    rng = random.Random(seed)
    records = []
    for i in range(n):
        h = hops[i % len(hops)]
        question, answer, steps = rng.choice(pools[h])
        chain = [entity for _, _, entity in steps]
        others = rng.sample([e for e in kb.entities() if e not in chain], distractors)
        corpus = chain + others
        rng.shuffle(corpus)
        documents = [{"id": str(j), "title": kb.paragraph(e)[0], "text": kb.paragraph(e)[1],
                      "supporting": e in chain} for j, e in enumerate(corpus)]
        decomposition = [{"question": q, "answer": a, "paragraph_support_idx": corpus.index(e)} for q, a, e in steps]
        records.append(PromptRecord(
            prompt=[{"role": "user", "content": question}], data_source="musique", ground_truth=answer,
            extra_info={"id": f"synthetic_{seed}_{i}", "question": question, "answer_aliases": [], "hops": h,
                        "supporting_ids": [d["id"] for d in documents if d["supporting"]], "documents": documents,
                        "decomposition": decomposition}))
    return records
