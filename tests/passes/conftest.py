"""Every pass test runs with TVM's well-formedness check around each transform."""

from __future__ import annotations

import pytest
import tvm
from tvm.relax.ir.instrument import WellFormedInstrument


@pytest.fixture(autouse=True)
def _well_formed() -> None:
    with tvm.transform.PassContext(instruments=[WellFormedInstrument()]):
        yield
