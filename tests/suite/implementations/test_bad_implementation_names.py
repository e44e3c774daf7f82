"""The bad-input battery (issue 20), ``--lora-impl`` values: names that are no implementation, malformed or hostile
``package.module:factory`` specs, and factories that do not give one, refused by
``lora_suite.implementations.resolve_implementation`` with what was expected."""

from __future__ import annotations

import re

import pytest

from lora_suite.implementations import ImplementationError, resolve_implementation

IMPL_CASES = {  # the value -> what the message must hold
    "": "expected a name",
    "   ": "expected a name",
    "nope": "'nope' is not known",
    "a b": "'a b': expected a name",
    "pkg.mod:": "expected package.module:factory (a dotted module path",
    ":make": "expected package.module:factory (a dotted module path",
    "../evil:x": "expected package.module:factory (a dotted module path",
    "os;rm -rf /:x": "expected package.module:factory (a dotted module path",
    "os:nonexistent": "cannot load 'nonexistent' from module 'os'",
    "lora_suite.nonexistent:make": "cannot load 'make' from module 'lora_suite.nonexistent'",
    "lora_suite.implementations:FEATURES": "gave a dict, not a lora_suite.implementations.LoRAImplementation",
    "json:dumps": "its factory 'dumps' raised TypeError",
    "json:JSONDecoder": "gave a type, not a lora_suite.implementations.LoRAImplementation",
    "peft-bnb-nope": "'peft-bnb-nope' is not known",
}


@pytest.mark.parametrize("spec", IMPL_CASES, ids=[repr(s) for s in IMPL_CASES])
def test_lora_impl_values(spec):
    with pytest.raises(ImplementationError, match=re.escape(IMPL_CASES[spec])):
        resolve_implementation(spec)
