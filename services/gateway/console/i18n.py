"""The console's two languages: English (the texts as written in the templates and code) and Simplified Chinese
with the seed's own terms, from one message catalogue (`locale/zh_CN/LC_MESSAGES/messages.po`, gettext's format,
kept with Babel: `pybabel extract`/`update`, see docs/console.md).

The catalogue is read when the gateway starts, so there is no compiled file to keep in step. A page's language
is the one the person chose (a cookie set by the switch), else the first of their browser's languages we have.
"""

from __future__ import annotations

import gettext
import io
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from babel import Locale, UnknownLocaleError
from babel.messages.mofile import write_mo
from babel.messages.pofile import read_po
from starlette.requests import HTTPConnection

LOCALE_DIR = Path(__file__).resolve().parent / "locale"
CATALOGUE = "messages.po"
LANGUAGES: dict[str, str] = {"en": "English", "zh-CN": "简体中文"}  # code -> its own name, for the switch
DEFAULT = "en"
LANGUAGE_COOKIE = "trainyard_lang"


def N_(text: str) -> str:
    """Marks a text for the catalogue without translating it here (it is translated where it is shown)."""
    return text


# Texts the pages' scripts show, translated into the page as data (the scripts hold no text of their own).
SCRIPT_TEXTS: tuple[str, ...] = (
    N_("Starts now"), N_("Queues"), N_("about"), N_("position"), N_("jobs ahead"), N_("cannot start:"),
    N_("Predicting…"), N_("The prediction is not available"), N_("connected"), N_("ended"), N_("reconnecting…"),
    N_("exit code"), N_("Loading…"), N_("No data yet"), N_("The session ended with exit code"),
    N_("The connection to the terminal was closed"),
)


@cache
def translations(language: str) -> gettext.NullTranslations:
    if language == DEFAULT:
        return gettext.NullTranslations()
    path = LOCALE_DIR / language.replace("-", "_") / "LC_MESSAGES" / CATALOGUE
    with path.open("rb") as po:
        catalogue = read_po(po, locale=language.replace("-", "_"))
    compiled = io.BytesIO()
    write_mo(compiled, catalogue)
    compiled.seek(0)
    return gettext.GNUTranslations(compiled)


def negotiate(accept_language: str) -> str:
    """The first language of an Accept-Language header that the console speaks (`zh`, `zh-TW`… read as zh-CN)."""
    wanted: list[tuple[float, str]] = []
    for position, part in enumerate(accept_language.split(",")[:20]):
        tag, _, params = part.strip().partition(";")
        quality = 1.0
        if params.strip().startswith("q="):
            try:
                quality = float(params.strip()[2:])
            except ValueError:
                quality = 0.0
        if tag:
            wanted.append((-quality + position * 1e-6, tag.strip()))
    for _, tag in sorted(wanted):
        try:
            language = Locale.parse(tag, sep="-").language
        except (ValueError, UnknownLocaleError):
            continue
        if language == "zh":
            return "zh-CN"
        if language == "en":
            return "en"
    return DEFAULT


def language_of(connection: HTTPConnection) -> str:
    chosen = connection.cookies.get(LANGUAGE_COOKIE)
    if chosen in LANGUAGES:
        return chosen
    return negotiate(connection.headers.get("accept-language", ""))


def script_texts(language: str) -> Mapping[str, str]:
    translate = translations(language).gettext
    return {text: translate(text) for text in SCRIPT_TEXTS}
