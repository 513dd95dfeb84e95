"""Text as the model reads it: Radford et al. (2017) cleaning and the UTF-8 byte encoding.

The cleaning is part of the model's input encoding, so the corpus, the feature extractor and the
served classifier all call this one function (the corpus stage has a vectorised twin that is
tested against it).
"""

from __future__ import annotations

import html

CLEANING = "radford2017"
CLEANING_DESCRIPTION = 'html.unescape; "\\n" -> " "; strip; "\\n " + text + " "'
FRONT_PAD = "\n "
END_PAD = " "

# Exactly the characters Python's str.strip() removes (str.isspace() is true), so a vectorised
# trim with this set matches clean_text() character for character.
# (Literal rather than computed: scanning all code points would cost 0.1 s at import.)
WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004"
    "\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def clean_text(text: str) -> str:
    """Clean one review the way Radford et al. did before reading it byte by byte."""
    text = html.unescape(text)
    text = text.replace("\n", " ").strip()
    return FRONT_PAD + text + END_PAD


def encode(text: str) -> bytes:
    """Clean a text and return the bytes the model reads (vocabulary: the 256 byte values)."""
    return clean_text(text).encode("utf-8")
