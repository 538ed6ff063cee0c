"""The one error of Hugging Face interop, and the path type its functions take."""
from __future__ import annotations

import os
from typing import Union

PathLike = Union[str, os.PathLike]


class HFFormatError(ValueError):
    """A checkpoint or config we cannot read or write; the message is one sentence."""
