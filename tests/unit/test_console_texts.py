"""The console's two languages: every text of its templates and code is in the Simplified Chinese catalogue,
translated, with its placeholders kept; and the pages' seed terms are the seed's own."""

from __future__ import annotations

import re
from pathlib import Path

from babel.messages.extract import extract_from_dir
from babel.messages.pofile import read_po

from services.gateway.console.i18n import LOCALE_DIR, negotiate, translations

GATEWAY = Path(__file__).resolve().parents[2] / "services" / "gateway"
METHODS = [("**/templates/**.html", "jinja2.ext:babel_extract"), ("**.py", "python")]
OPTIONS = {"**/templates/**.html": {"extensions": "jinja2.ext.i18n"}}
KEYWORDS = {"_": None, "gettext": None, "ngettext": (1, 2), "N_": None}
PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def extracted() -> set[str | tuple[str, str]]:
    found: set[str | tuple[str, str]] = set()
    for _, _, message, _, _ in extract_from_dir(str(GATEWAY), METHODS, OPTIONS, KEYWORDS):
        found.add(message if isinstance(message, str) else (message[0], message[1]))
    return found


def catalogue() -> dict[str | tuple[str, str], str | tuple[str, ...]]:
    with (LOCALE_DIR / "zh_CN" / "LC_MESSAGES" / "messages.po").open("rb") as po:
        read = read_po(po, locale="zh_CN")
    return {(m.id if isinstance(m.id, str) else tuple(m.id)): m.string for m in read if m.id}  # type: ignore[misc]


def test_every_text_of_the_console_is_translated_with_its_placeholders() -> None:
    texts, translated = extracted(), catalogue()
    missing = [text for text in texts if not translated.get(text)]
    assert not missing, f"not in the catalogue, or untranslated (docs/console.md, Two languages): {missing}"
    for text in texts:
        source = text if isinstance(text, str) else text[0]
        target = translated[text]
        for form in [target] if isinstance(target, str) else list(target):
            assert set(PLACEHOLDER.findall(form)) == set(PLACEHOLDER.findall(source)), (text, form)


def test_the_catalogue_holds_no_text_the_console_no_longer_shows() -> None:
    stale = set(catalogue()) - extracted()
    assert not stale, f"texts no page shows any more: {stale}"


def test_the_seed_terms_are_the_seeds_own() -> None:
    zh = translations("zh-CN").gettext
    assert [zh(s) for s in ("Queued", "Running", "Failed", "Stopped", "Expired", "Succeeded")] == \
        ["排队中", "运行中", "错误", "停止", "过期", "成功"]
    assert zh("Jobs") == "任务式训练" and zh("Adjust priority") == "调整优先级" and zh("Operations") == "操作"


def test_the_browser_language_chooses_the_page_language() -> None:
    assert negotiate("zh-CN,zh;q=0.9,en;q=0.8") == "zh-CN"
    assert negotiate("en-US,en;q=0.9,zh-CN;q=0.8") == "en"
    assert negotiate("fr-FR,zh-TW;q=0.5") == "zh-CN"
    assert negotiate("fr-FR") == "en" and negotiate("") == "en" and negotiate(";;;,q=x") == "en"
