"""Regexes in config documents are matched within a bound (issue 27, finding 5).

``(a|a)*!`` doubles its matching time with every character of a module name under Python's
backtracking ``re`` (0.94 s at 22 characters, hours for a 35-character Hugging Face path); a
document carrying it must be refused when it is read, naming the field, before any match runs.
"""

from __future__ import annotations

import re

import pytest

import qplug_core as qp
from qplug_core.config.regex_bound import MAX_LENGTH, MAX_REPEATS
from qplug_core.errors import ConfigValidationError

HOSTILE = {
    "repeated alternation": r"(a|a)*!",
    "repeated alternation, no group": r"(?:a|aa)+!",
    "nested repeat": r"(a+)+!",
    "nested bounded repeat": r"(a{1,30}){1,30}!",
    "backreference": r"(a*)\1!",
    "conditional group": r"(a)?(?(1)a|b)",
    "too many repeats": r"a*" * (MAX_REPEATS + 1) + "!",
    "too long": "a" * (MAX_LENGTH + 1),
}


def document(regex: str) -> dict:
    return {"schema_version": 1, "global": None, "object_type": [],
            "module_name_regex": [[regex, None]], "module_name": [], "module_name_object_type_order": []}


@pytest.mark.parametrize("regex", list(HOSTILE.values()), ids=list(HOSTILE))
def test_unbounded_regexes_are_refused_naming_the_field(regex):
    with pytest.raises(ConfigValidationError, match="module_name_regex") as info:
        qp.QConfigMapping.from_dict(document(regex))
    assert "module_name_regex" in str(info.value.field)
    with pytest.raises(ConfigValidationError, match="refused"):
        qp.QConfigMapping().set_module_name_regex(regex, None)


@pytest.mark.parametrize("regex, path, matches", [
    (r"layers\.\d+\.attn", "layers.11.attn.q_proj", True),
    (r"(encoder|decoder)\..*fc[12]", "decoder.block.3.fc2", True),
    (r"(encoder|decoder)\..*fc[12]", "embed.fc1", False),
    (r".*\.(q|k|v)_proj", "model.layers.0.self_attn.k_proj", True),
    (r"a{2,5}b", "aaab", True),
])
def test_ordinary_regexes_still_match_as_re_does(regex, path, matches):
    qconfig = qp.get_default_qconfig_mapping("reference").global_qconfig
    mapping = qp.QConfigMapping.from_dict(qp.QConfigMapping().set_module_name_regex(regex, qconfig)
                                          .to_dict())
    assert (mapping._regex_qconfig(path, None) is not None) == matches == bool(re.match(regex, path))


def test_invalid_regexes_still_say_why():
    with pytest.raises(ConfigValidationError, match="not a valid regular expression"):
        qp.QConfigMapping().set_module_name_regex("(unclosed", None)
