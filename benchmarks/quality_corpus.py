"""The fixed real-text corpus of `quality.py`: English prose and Python code found on this machine,
written once into `benchmarks/data/quality_corpus.jsonl` (one passage a line: its kind, its
origin, its text) so that every run reads the same text whatever Python is installed.

Sources (no network): the Python reference manual's text that every CPython installation carries
in `pydoc_data.topics`; the source of stable standard-library functions (`inspect.getsource`);
license texts that ship with Python and with packages in the virtual environment; and a few
public-domain English texts written out below. Regenerate (and review the diff) with

    .venv/bin/python benchmarks/quality_corpus.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import platform
import sysconfig
from pathlib import Path

CORPUS = Path(__file__).parent / "data" / "quality_corpus.jsonl"
PASSAGE_CHARS = 1400  # about 300 SmolLM2 tokens of prose (code takes more tokens a character)

TOPICS = ("assert", "assignment", "async", "attribute-access", "binary", "booleans", "break",
          "calls", "class", "comparisons", "context-managers", "customization", "dict",
          "exceptions", "execmodel", "for", "formatstrings", "function", "if", "import",
          "lambda", "naming", "numbers", "raise", "return", "slicings", "string-methods",
          "truth", "try", "while", "with", "yield")
FUNCTIONS = ("textwrap:dedent", "textwrap:TextWrapper._wrap_chunks", "heapq:nlargest",
             "heapq:merge", "ast:literal_eval", "functools:total_ordering",
             "shlex:split", "fnmatch:translate", "pprint:PrettyPrinter._format",
             "argparse:ArgumentParser.parse_known_args",
             "collections:Counter.most_common", "statistics:median", "difflib:get_close_matches",
             "string:capwords")
LICENSES = (("the PSF license that ships with CPython", "LICENSE.txt", 200),
            ("typer's MIT license (venv)", "typer-*.dist-info/licenses/LICENSE", 0),
            ("cryptography's Apache-2.0 license (venv)",
             "cryptography-*.dist-info/licenses/LICENSE.APACHE", 3000),
            ("cryptography's BSD license (venv)",
             "cryptography-*.dist-info/licenses/LICENSE.BSD", 0))

# public-domain English prose, written out
WRITTEN = {
    "Abraham Lincoln, the Gettysburg Address (1863)": (
        "Four score and seven years ago our fathers brought forth on this continent, a new "
        "nation, conceived in Liberty, and dedicated to the proposition that all men are created "
        "equal. Now we are engaged in a great civil war, testing whether that nation, or any "
        "nation so conceived and so dedicated, can long endure. We are met on a great "
        "battle-field of that war. We have come to dedicate a portion of that field, as a final "
        "resting place for those who here gave their lives that that nation might live. It is "
        "altogether fitting and proper that we should do this. But, in a larger sense, we can "
        "not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave "
        "men, living and dead, who struggled here, have consecrated it, far above our poor power "
        "to add or detract. The world will little note, nor long remember what we say here, but "
        "it can never forget what they did here. It is for us the living, rather, to be "
        "dedicated here to the unfinished work which they who fought here have thus far so "
        "nobly advanced. It is rather for us to be here dedicated to the great task remaining "
        "before us -- that from these honored dead we take increased devotion to that cause for "
        "which they gave the last full measure of devotion -- that we here highly resolve that "
        "these dead shall not have died in vain -- that this nation, under God, shall have a new "
        "birth of freedom -- and that government of the people, by the people, for the people, "
        "shall not perish from the earth."),
    "Charles Dickens, A Tale of Two Cities (1859), the opening": (
        "It was the best of times, it was the worst of times, it was the age of wisdom, it was "
        "the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, "
        "it was the season of Light, it was the season of Darkness, it was the spring of hope, "
        "it was the winter of despair, we had everything before us, we had nothing before us, "
        "we were all going direct to Heaven, we were all going direct the other way -- in short, "
        "the period was so far like the present period, that some of its noisiest authorities "
        "insisted on its being received, for good or for evil, in the superlative degree of "
        "comparison only. There were a king with a large jaw and a queen with a plain face, on "
        "the throne of England; there were a king with a large jaw and a queen with a fair "
        "face, on the throne of France. In both countries it was clearer than crystal to the "
        "lords of the State preserves of loaves and fishes, that things in general were settled "
        "for ever."),
    "The United States Declaration of Independence (1776), its second paragraph": (
        "We hold these truths to be self-evident, that all men are created equal, that they are "
        "endowed by their Creator with certain unalienable Rights, that among these are Life, "
        "Liberty and the pursuit of Happiness. That to secure these rights, Governments are "
        "instituted among Men, deriving their just powers from the consent of the governed, "
        "That whenever any Form of Government becomes destructive of these ends, it is the "
        "Right of the People to alter or to abolish it, and to institute new Government, laying "
        "its foundation on such principles and organizing its powers in such form, as to them "
        "shall seem most likely to effect their Safety and Happiness. Prudence, indeed, will "
        "dictate that Governments long established should not be changed for light and "
        "transient causes; and accordingly all experience hath shewn, that mankind are more "
        "disposed to suffer, while evils are sufferable, than to right themselves by abolishing "
        "the forms to which they are accustomed."),
    "Jane Austen, Pride and Prejudice (1813), the opening": (
        "It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known the feelings or views of such "
        "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
        "minds of the surrounding families, that he is considered the rightful property of some "
        "one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, "
        "\"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had "
        "not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me "
        "all about it.\" Mr. Bennet made no answer. \"Do you not want to know who has taken "
        "it?\" cried his wife impatiently. \"You want to tell me, and I have no objection to "
        "hearing it.\" This was invitation enough."),
    "Herman Melville, Moby-Dick (1851), the opening": (
        "Call me Ishmael. Some years ago -- never mind how long precisely -- having little or no "
        "money in my purse, and nothing particular to interest me on shore, I thought I would "
        "sail about a little and see the watery part of the world. It is a way I have of "
        "driving off the spleen and regulating the circulation. Whenever I find myself growing "
        "grim about the mouth; whenever it is a damp, drizzly November in my soul; whenever I "
        "find myself involuntarily pausing before coffin warehouses, and bringing up the rear "
        "of every funeral I meet; and especially whenever my hypos get such an upper hand of "
        "me, that it requires a strong moral principle to prevent me from deliberately stepping "
        "into the street, and methodically knocking people's hats off -- then, I account it "
        "high time to get to sea as soon as I can."),
    "The Constitution of the United States (1787), the preamble and Article I, Section 1": (
        "We the People of the United States, in Order to form a more perfect Union, establish "
        "Justice, insure domestic Tranquility, provide for the common defence, promote the "
        "general Welfare, and secure the Blessings of Liberty to ourselves and our Posterity, "
        "do ordain and establish this Constitution for the United States of America. All "
        "legislative Powers herein granted shall be vested in a Congress of the United States, "
        "which shall consist of a Senate and House of Representatives."),
}


def _window(text: str, start: int = 0) -> str:
    """About PASSAGE_CHARS characters of `text` from `start`, ending at a line or word end."""
    chunk = text[start:start + PASSAGE_CHARS]
    cut = max(chunk.rfind("\n"), chunk.rfind(" "))
    return chunk if len(text) <= start + PASSAGE_CHARS or cut < 0 else chunk[:cut]


def _source(spec: str) -> str:
    module_name, _, qualname = spec.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)  # type: ignore[arg-type]


def _license(pattern: str) -> Path:
    if "/" not in pattern:  # CPython's own, next to its standard library
        return Path(os.__file__).parent / pattern
    site = Path(sysconfig.get_paths()["purelib"])
    matches = sorted(site.glob(pattern))
    if not matches:
        raise FileNotFoundError(f"no license file matches {pattern!r} under {site}")
    return matches[0]


def build() -> list[dict[str, str]]:
    """Every passage, in a fixed order: reference-manual prose, code, licenses, written prose."""
    from pydoc_data.topics import topics

    version = platform.python_version()
    passages = [{"kind": "prose", "origin": f"pydoc_data.topics[{key!r}] (CPython {version})",
                 "text": _window(topics[key])} for key in TOPICS]
    passages += [{"kind": "code", "origin": f"inspect.getsource({spec}) (CPython {version})",
                  "text": _window(_source(spec))} for spec in FUNCTIONS]
    for origin, pattern, start in LICENSES:
        path = _license(pattern)
        passages.append({"kind": "license", "origin": f"{origin}: {path.name}",
                         "text": _window(path.read_text(), start)})
    passages += [{"kind": "prose", "origin": f"{origin}, written out (public domain)",
                  "text": text} for origin, text in WRITTEN.items()]
    return passages


def load(path: Path = CORPUS) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    passages = build()
    CORPUS.parent.mkdir(parents=True, exist_ok=True)
    CORPUS.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in passages))
    print(f"{len(passages)} passages, {sum(len(p['text']) for p in passages)} characters "
          f"-> {CORPUS}")


if __name__ == "__main__":
    main()
