"""Text for synthetic pages: words, names, companies, addresses, dates, numbers and amounts.

Names, addresses, companies and sentences come from the `faker` package in several locales (a
dependency of ocria-rt, pinned to one version: its data and formats change between releases, and with
them the pages of a seed), or, with ``PageConfig(use_faker=False)``, from the built-in word lists
(:mod:`.words`). Asking for faker without it installed is an error, never a silent switch to the
word lists. Dates, numbers and amounts are formatted here with each locale's conventions (decimal
comma, currency position, month names), so both sources produce the same kinds of strings. Everything
a TextSource returns has been through the page's `clean` function (characters the page's fonts cannot
draw are transliterated) and is safe inside Markdown (no emphasis, code, HTML or link markers).
:func:`text_source` names the source a configuration draws from, for training records and checks.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import random
import re
from collections.abc import Callable
from datetime import date, timedelta
from functools import lru_cache

from . import words as W

try:  # a dependency of ocria-rt; missing only where it was installed without its dependencies
    import faker as _faker_mod
except ImportError:  # pragma: no cover - depends on the environment
    _faker_mod = None

#: (locale, weight); the locale decides names, words, number and date formats.
LOCALES: tuple[tuple[str, float], ...] = (
    ("en_US", 0.34), ("en_GB", 0.10), ("de_DE", 0.12), ("fr_FR", 0.10), ("es_ES", 0.10),
    ("it_IT", 0.08), ("nl_NL", 0.06), ("pl_PL", 0.05), ("da_DK", 0.05),
)
# faker locales whose lorem provider has words of that language (the others use en_US's words)
_LOREM_LOCALES = {"en_US", "de_DE", "fr_FR", "es_ES", "it_IT", "nl_NL", "pl_PL", "da_DK"}

MONTHS = {
    "en": "January February March April May June July August September October November December",
    "de": "Januar Februar März April Mai Juni Juli August September Oktober November Dezember",
    "fr": "janvier février mars avril mai juin juillet août septembre octobre novembre décembre",
    "es": "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre",
    "it": "gennaio febbraio marzo aprile maggio giugno luglio agosto settembre ottobre novembre dicembre",
    "nl": "januari februari maart april mei juni juli augustus september oktober november december",
    "da": "januar februar marts april maj juni juli august september oktober november december",
    "pl": "stycznia lutego marca kwietnia maja czerwca lipca sierpnia września października listopada grudnia",
}

# locale -> (decimal sep, thousands sep, currency pattern with {v}, date patterns)
_FORMATS: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    "en_US": (".", ",", ("${v}", "USD {v}", "{v} USD"), ("{m:02d}/{d:02d}/{Y}", "{B} {d}, {Y}", "{Y}-{m:02d}-{d:02d}", "{b} {d}, {Y}")),
    "en_GB": (".", ",", ("£{v}", "GBP {v}"), ("{d:02d}/{m:02d}/{Y}", "{d} {B} {Y}", "{Y}-{m:02d}-{d:02d}", "{d} {b} {Y}")),
    "de_DE": (",", ".", ("{v} €", "{v} EUR", "EUR {v}"), ("{d:02d}.{m:02d}.{Y}", "{d}. {B} {Y}", "{Y}-{m:02d}-{d:02d}")),
    "fr_FR": (",", " ", ("{v} €", "{v} EUR"), ("{d:02d}/{m:02d}/{Y}", "{d} {B} {Y}", "{Y}-{m:02d}-{d:02d}")),
    "es_ES": (",", ".", ("{v} €", "{v} EUR"), ("{d:02d}/{m:02d}/{Y}", "{d} de {B} de {Y}", "{Y}-{m:02d}-{d:02d}")),
    "it_IT": (",", ".", ("€ {v}", "{v} €", "EUR {v}"), ("{d:02d}/{m:02d}/{Y}", "{d} {B} {Y}", "{Y}-{m:02d}-{d:02d}")),
    "nl_NL": (",", ".", ("€ {v}", "EUR {v}"), ("{d:02d}-{m:02d}-{Y}", "{d} {B} {Y}", "{Y}-{m:02d}-{d:02d}")),
    "pl_PL": (",", " ", ("{v} zł", "{v} PLN"), ("{d:02d}.{m:02d}.{Y}", "{d} {B} {Y}", "{Y}-{m:02d}-{d:02d}")),
    "da_DK": (",", ".", ("{v} kr.", "DKK {v}", "kr. {v}"), ("{d:02d}.{m:02d}.{Y}", "{d}. {B} {Y}", "{Y}-{m:02d}-{d:02d}")),
}

# labels of forms and invoices, per language (English where a language has no entry)
LABELS: dict[str, dict[str, str]] = {
    "en": {"invoice": "Invoice", "invoice_no": "Invoice No.", "date": "Date", "due": "Due date", "bill_to": "Bill to",
           "description": "Description", "qty": "Qty", "unit_price": "Unit price", "amount": "Amount",
           "subtotal": "Subtotal", "tax": "Tax", "total": "Total", "customer_no": "Customer No.",
           "order_no": "Order No.", "payment": "Payment terms", "bank": "Bank", "iban": "IBAN", "page": "Page",
           "of": "of", "name": "Name", "address": "Address", "phone": "Phone", "email": "Email",
           "birth": "Date of birth", "city": "City", "signature": "Signature", "reference": "Reference",
           "dear": "Dear", "regards": "Kind regards", "subject": "Subject", "item": "Item", "ship_to": "Ship to",
           "vat_id": "VAT ID", "discount": "Discount", "occupation": "Occupation", "company": "Company"},
    "de": {"invoice": "Rechnung", "invoice_no": "Rechnungsnummer", "date": "Datum", "due": "Fällig am",
           "bill_to": "Rechnungsempfänger", "description": "Beschreibung", "qty": "Menge", "unit_price": "Einzelpreis",
           "amount": "Betrag", "subtotal": "Zwischensumme", "tax": "MwSt.", "total": "Gesamtbetrag",
           "customer_no": "Kundennummer", "order_no": "Bestellnummer", "payment": "Zahlungsbedingungen",
           "bank": "Bank", "iban": "IBAN", "page": "Seite", "of": "von", "name": "Name", "address": "Anschrift",
           "phone": "Telefon", "email": "E-Mail", "birth": "Geburtsdatum", "city": "Ort", "signature": "Unterschrift",
           "reference": "Referenz", "dear": "Sehr geehrte Damen und Herren", "regards": "Mit freundlichen Grüßen",
           "subject": "Betreff", "item": "Pos.", "ship_to": "Lieferadresse", "vat_id": "USt-IdNr.",
           "discount": "Rabatt", "occupation": "Beruf", "company": "Firma"},
    "fr": {"invoice": "Facture", "invoice_no": "N° de facture", "date": "Date", "due": "Échéance",
           "bill_to": "Facturé à", "description": "Désignation", "qty": "Qté", "unit_price": "Prix unitaire",
           "amount": "Montant", "subtotal": "Sous-total", "tax": "TVA", "total": "Total TTC",
           "customer_no": "N° client", "order_no": "N° de commande", "payment": "Conditions de paiement",
           "bank": "Banque", "iban": "IBAN", "page": "Page", "of": "sur", "name": "Nom", "address": "Adresse",
           "phone": "Téléphone", "email": "E-mail", "birth": "Date de naissance", "city": "Ville",
           "signature": "Signature", "reference": "Référence", "dear": "Madame, Monsieur",
           "regards": "Cordialement", "subject": "Objet", "item": "Réf.", "ship_to": "Livré à",
           "vat_id": "N° TVA", "discount": "Remise", "occupation": "Profession", "company": "Société"},
    "es": {"invoice": "Factura", "invoice_no": "N.º de factura", "date": "Fecha", "due": "Vencimiento",
           "bill_to": "Facturar a", "description": "Descripción", "qty": "Cant.", "unit_price": "Precio unitario",
           "amount": "Importe", "subtotal": "Subtotal", "tax": "IVA", "total": "Total", "customer_no": "N.º de cliente",
           "order_no": "N.º de pedido", "payment": "Condiciones de pago", "bank": "Banco", "iban": "IBAN",
           "page": "Página", "of": "de", "name": "Nombre", "address": "Dirección", "phone": "Teléfono",
           "email": "Correo", "birth": "Fecha de nacimiento", "city": "Ciudad", "signature": "Firma",
           "reference": "Referencia", "dear": "Estimados señores", "regards": "Atentamente", "subject": "Asunto",
           "item": "Ref.", "ship_to": "Enviar a", "vat_id": "NIF", "discount": "Descuento",
           "occupation": "Profesión", "company": "Empresa"},
}

_UNSAFE = re.compile(r"[*_`<>|\\\[\]{}~^#]")
_SPACES = re.compile(r"\s+")


@lru_cache(maxsize=32)
def _faker(locale: str):  # -> faker.Faker
    return _faker_mod.Faker(locale)


def faker_available() -> bool:
    return _faker_mod is not None


class TextSourceMissing(ImportError):
    """The page text should come from faker and faker is not installed."""


def _faker_requirement() -> str:
    """ocria-rt's requirement on faker ("faker==X"), as installed; a fallback phrase where the package's
    metadata is not there (synthdoc imported from a source tree)."""
    try:
        reqs = importlib.metadata.requires("ocria-rt") or []
    except importlib.metadata.PackageNotFoundError:
        reqs = []
    pins = [r for r in reqs if re.match(r"faker\s*==", r, re.I) and ";" not in r]
    return pins[0].replace(" ", "") if pins else "the faker version ocria-rt's pyproject.toml pins"


def _require_faker() -> None:
    if _faker_mod is None:
        raise TextSourceMissing(
            f"synthdoc: the page text comes from the faker package, which is not installed (ocria-rt depends "
            f"on it: pip install {_faker_requirement()}); PageConfig(use_faker=False) draws from the "
            f"built-in word lists instead, which is other text")


@lru_cache(maxsize=1)
def _word_lists_digest() -> str:
    lists = (W.WORDS, W.FIRST_NAMES, W.LAST_NAMES, W.CITIES, W.STREETS, W.STREET_KINDS, W.COMPANY_WORDS,
             W.COMPANY_SUFFIXES, W.JOBS, W.PRODUCTS)
    return hashlib.sha256("\n".join(" ".join(x) for x in lists).encode()).hexdigest()[:16]


def text_source(use_faker: bool = True) -> dict[str, str]:
    """Where the words of pages come from: {"generator": "faker", "version": ...} (the installed
    faker's version: pages of a seed are the same wherever it is the same) or {"generator": "synthdoc
    word lists", "sha256": ...} (a digest of the built-in lists). Raises TextSourceMissing when
    `use_faker` and faker is not installed."""
    if not use_faker:
        return {"generator": "synthdoc word lists", "sha256": _word_lists_digest()}
    _require_faker()
    return {"generator": "faker", "version": str(_faker_mod.VERSION)}


def md_safe(text: str) -> str:
    """One line of plain text that Markdown shows as is: markup characters removed, spaces collapsed."""
    return _SPACES.sub(" ", _UNSAFE.sub("", text)).strip()


class TextSource:
    """Strings for one page, drawn from `rng` (and a faker instance seeded from it)."""

    def __init__(self, rng: random.Random, locale: str, use_faker: bool, clean: Callable[[str], str]) -> None:
        self.rng = rng
        self.locale = locale
        self.lang = locale.split("_")[0]
        self._clean = clean
        self.fake = None
        self.lorem = None
        if use_faker:
            _require_faker()
            self.fake = _faker(locale)
            self.fake.seed_instance(rng.getrandbits(48))
            if locale in _LOREM_LOCALES:
                self.lorem = self.fake
            else:
                self.lorem = _faker("en_US")
                self.lorem.seed_instance(rng.getrandbits(48))
        self.dec, self.thou, self.currency_patterns, self.date_patterns = _FORMATS.get(locale, _FORMATS["en_US"])
        self.currency = rng.choice(self.currency_patterns)
        self.date_pattern = rng.choice(self.date_patterns)
        self.months = MONTHS.get(self.lang, MONTHS["en"]).split()
        self.labels = LABELS.get(self.lang, LABELS["en"]) if rng.random() < 0.8 else LABELS["en"]
        self.year = rng.randint(1995, 2030)

    # ---- plumbing ----
    def clean(self, text: str) -> str:
        return md_safe(self._clean(md_safe(text)))

    def label(self, key: str) -> str:
        return self.clean(self.labels.get(key) or LABELS["en"][key])

    # ---- words and sentences ----
    def word(self) -> str:
        if self.lorem is not None:
            return self.clean(self.lorem.word())
        return self.rng.choice(W.WORDS)

    def words(self, n: int) -> list[str]:
        out = [self.word() for _ in range(n)]
        return [w for w in out if w] or ["text"]

    def pseudo_word(self) -> str:
        """A pronounceable non-word (forces reading letter by letter)."""
        cons, vows = "bcdfghklmnprstvwz", "aeiou"
        n = self.rng.randint(2, 4)
        s = "".join(self.rng.choice(cons) + self.rng.choice(vows) + (self.rng.choice(cons) if self.rng.random() < 0.3 else "")
                    for _ in range(n))
        return s

    def sentence(self, lo: int = 5, hi: int = 16) -> str:
        n = self.rng.randint(lo, hi)
        ws = self.words(n)
        if self.rng.random() < 0.08:
            ws[self.rng.randrange(len(ws))] = self.pseudo_word()
        if self.rng.random() < 0.12:
            ws.insert(self.rng.randrange(len(ws) + 1), self.inline_value())
        if n > 8 and self.rng.random() < 0.25:
            ws[self.rng.randrange(2, n - 1)] += ","
        s = " ".join(ws)
        s = s[:1].upper() + s[1:]
        end = "." if self.rng.random() > 0.06 else self.rng.choice("!?")
        return self.clean(s + end)

    def paragraph(self, lo: int = 2, hi: int = 6) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randint(lo, hi)))

    def title(self, lo: int = 2, hi: int = 7) -> str:
        ws = self.words(self.rng.randint(lo, hi))
        style = self.rng.random()
        if style < 0.35:
            ws = [w[:1].upper() + w[1:] for w in ws]
        elif style < 0.45:
            ws = [w.upper() for w in ws]
        else:
            ws[0] = ws[0][:1].upper() + ws[0][1:]
        return self.clean(" ".join(ws))

    def inline_value(self) -> str:
        r = self.rng.random()
        if r < 0.3:
            return self.date()
        if r < 0.55:
            return self.amount(self.money_value())
        if r < 0.75:
            return self.number(self.rng.randint(2, 99999))
        if r < 0.9:
            return self.percent()
        return self.code()

    # ---- entities ----
    def first_name(self) -> str:
        return self.clean(self.fake.first_name() if self.fake else self.rng.choice(W.FIRST_NAMES))

    def last_name(self) -> str:
        return self.clean(self.fake.last_name() if self.fake else self.rng.choice(W.LAST_NAMES))

    def name(self) -> str:
        if self.fake is not None:
            return self.clean(self.fake.name())
        return f"{self.first_name()} {self.last_name()}"

    def company(self) -> str:
        if self.fake is not None:
            return self.clean(self.fake.company())
        return f"{self.rng.choice(W.COMPANY_WORDS)} {self.rng.choice(W.COMPANY_SUFFIXES)}"

    def job(self) -> str:
        if self.fake is not None:
            return self.clean(self.fake.job())[:40].strip()
        return self.rng.choice(W.JOBS)

    def city(self) -> str:
        return self.clean(self.fake.city() if self.fake else self.rng.choice(W.CITIES))

    def address_lines(self) -> list[str]:
        if self.fake is not None:
            lines = [self.clean(x) for x in self.fake.address().split("\n")]
            return [x for x in lines if x]
        street = f"{self.rng.randint(1, 999)} {self.rng.choice(W.STREETS)} {self.rng.choice(W.STREET_KINDS)}"
        return [street, f"{self.city()} {self.rng.randint(10000, 99999)}"]

    def email(self) -> str:
        if self.fake is not None:
            return self.clean(self.fake.email().replace("_", "."))
        return f"{self.first_name().lower()}.{self.last_name().lower()}@example.com"

    def phone(self) -> str:
        if self.fake is not None:
            return self.clean(self.fake.phone_number())
        return f"+1 {self.rng.randint(200, 999)} {self.rng.randint(200, 999)} {self.rng.randint(1000, 9999)}"

    def iban(self) -> str:
        if self.fake is not None:
            try:
                return self.clean(self.fake.iban())
            except AttributeError:
                pass
        cc = self.locale.split("_")[1]
        return cc + "".join(str(self.rng.randint(0, 9)) for _ in range(20))

    def product(self) -> str:
        ws = [self.rng.choice(W.PRODUCTS)] if self.rng.random() < 0.5 else self.words(1)
        if self.rng.random() < 0.6:
            ws = self.words(self.rng.randint(1, 2)) + ws
        s = " ".join(ws)
        return self.clean(s[:1].upper() + s[1:])

    def code(self, prefix: str | None = None) -> str:
        p = prefix if prefix is not None else self.rng.choice(["INV", "PO", "REF", "SKU", "ID", "NR", "AB", ""])
        digits = "".join(str(self.rng.randint(0, 9)) for _ in range(self.rng.randint(3, 7)))
        if self.rng.random() < 0.3:
            digits = f"{self.year}-{digits}"
        return f"{p}-{digits}" if p else digits

    # ---- numbers, dates, amounts ----
    def _group(self, s: str) -> str:
        neg = s.startswith("-")
        s = s.lstrip("-")
        parts: list[str] = []
        while len(s) > 3:
            parts.insert(0, s[-3:])
            s = s[:-3]
        parts.insert(0, s)
        return ("-" if neg else "") + self.thou.join(parts)

    def number(self, x: float, decimals: int = 0, grouping: bool = True) -> str:
        s = f"{x:.{decimals}f}"
        ip, _, fp = s.partition(".")
        if grouping and abs(x) >= 1000:
            ip = self._group(ip)
        return self.clean(ip + (self.dec + fp if decimals else ""))

    def money_value(self, lo: float = 1.0, hi: float = 5000.0) -> float:
        v = 10 ** self.rng.uniform(_log10(lo), _log10(hi))
        return round(v, 2)

    def amount(self, x: float, currency: bool = True) -> str:
        v = self.number(x, 2)
        return self.clean(self.currency.format(v=v)) if currency else v

    def percent(self) -> str:
        d = self.rng.choice([0, 0, 1, 2])
        v = self.number(self.rng.uniform(0, 100), d, grouping=False)
        return v + (" %" if self.lang in ("de", "fr", "da", "pl") else "%")

    def random_date(self) -> date:
        return date(self.year, 1, 1) + timedelta(days=self.rng.randint(0, 364))

    def date(self, d: date | None = None, pattern: str | None = None) -> str:
        d = d or self.random_date()
        p = pattern or self.date_pattern
        return self.clean(p.format(d=d.day, m=d.month, Y=d.year, B=self.months[d.month - 1],
                                   b=self.months[d.month - 1][:3]))


def _log10(x: float) -> float:
    import math

    return math.log10(x)


def pick_locale(rng: random.Random, locales: tuple[str, ...] | None = None) -> str:
    if locales:
        return rng.choice(list(locales))
    names, weights = zip(*LOCALES)
    return rng.choices(names, weights=weights)[0]
