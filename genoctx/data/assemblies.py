"""Known genome assemblies: where their files live (UCSC layout), their md5 lists and chromosome sizes.

Design choices:
- An assembly is a small frozen dataclass, not a registry of classes: ``ASSEMBLIES["hg38"]``.
- URLs follow UCSC's goldenPath layout under one base URL, so a mirror or a local copy served over
  HTTP with the same tree is one ``--base-url`` (or ``$GENOCTX_BASE_URL``) away::

      {base}/chromosomes/chr1.fa.gz ... chr22.fa.gz, chrX, chrY, chrM   + {base}/chromosomes/md5sum.txt
      {base}/bigZips/hg38.fa.gz  {base}/bigZips/hg38.chrom.sizes          + {base}/bigZips/md5sum.txt

- Checksums and sizes are read from the server (``md5sum.txt`` beside each set of files,
  ``hg38.chrom.sizes``), never hard-coded, so a mirror of another release still verifies; the UCSC
  lengths of a few chromosomes are kept here only to document and test the parser
  (chr1 248,956,422; chr2 242,193,529; chr22 50,818,468 bases).

Reference: UCSC hg38 downloads, https://hgdownload.soe.ucsc.edu/goldenPath/hg38/ (bigZips/README.txt).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from genoctx.errors import GenoctxError

BASE_URL_ENV = "GENOCTX_BASE_URL"


@dataclass(frozen=True)
class Assembly:
    """One assembly at UCSC (or a mirror with the same layout).

    Attributes:
        name: UCSC name, e.g. ``"hg38"``.
        base_url: default base, e.g. ``https://hgdownload.soe.ucsc.edu/goldenPath/hg38``.
        chromosomes: the primary chromosome names (per-chromosome files exist for each).
        ucsc_sizes: a few lengths in bases as published by UCSC (documentation and tests only).
    """

    name: str
    base_url: str
    chromosomes: tuple[str, ...]
    ucsc_sizes: dict[str, int] = field(default_factory=dict)

    def chromosome_path(self, chrom: str) -> str:
        """Path under the base URL of one chromosome's gzip FASTA: ``chromosomes/chr1.fa.gz``."""
        return f"chromosomes/{chrom}.fa.gz"

    @property
    def genome_path(self) -> str:
        """Path of the whole-genome gzip FASTA: ``bigZips/hg38.fa.gz``."""
        return f"bigZips/{self.name}.fa.gz"

    @property
    def sizes_path(self) -> str:
        """Path of the chromosome sizes table: ``bigZips/hg38.chrom.sizes`` (name TAB length)."""
        return f"bigZips/{self.name}.chrom.sizes"

    @staticmethod
    def md5_path(file_path: str) -> str:
        """Path of the ``md5sum.txt`` beside ``file_path``."""
        folder = file_path.rsplit("/", 1)[0] if "/" in file_path else ""
        return f"{folder}/md5sum.txt" if folder else "md5sum.txt"


HG38 = Assembly(
    name="hg38",
    base_url="https://hgdownload.soe.ucsc.edu/goldenPath/hg38",
    chromosomes=tuple(f"chr{i}" for i in range(1, 23)) + ("chrX", "chrY", "chrM"),
    ucsc_sizes={"chr1": 248_956_422, "chr2": 242_193_529, "chr22": 50_818_468, "chrM": 16_569},
)

ASSEMBLIES: dict[str, Assembly] = {"hg38": HG38}


def get_assembly(name: str) -> Assembly:
    """The assembly called ``name``.

    Raises:
        GenoctxError: unknown name (the known ones are listed).
    """
    try:
        return ASSEMBLIES[name]
    except KeyError:
        raise GenoctxError(f"unknown assembly {name!r}; known: {', '.join(sorted(ASSEMBLIES))}") from None


def resolve_base_url(assembly: Assembly, base_url: str | None = None) -> str:
    """``base_url``, else ``$GENOCTX_BASE_URL``, else the assembly's own (UCSC); without a trailing ``/``."""
    return (base_url or os.environ.get(BASE_URL_ENV) or assembly.base_url).rstrip("/")


def parse_md5sum(text: str, source: str = "md5sum.txt") -> dict[str, str]:
    """Parse ``md5sum`` output (``<32 hex>  <name>``, ``*name`` for binary mode) into ``{name: md5}``.

    Raises:
        GenoctxError: a non-blank line that is not ``md5  name`` (the line is quoted).
    """
    result = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split(None, 1)
        md5 = parts[0].lower()
        if len(parts) != 2 or len(md5) != 32 or any(c not in "0123456789abcdef" for c in md5):
            raise GenoctxError(f"{source}: line {number} is not 'md5  name': {line[:80]!r}")
        result[parts[1].strip().lstrip("*").removeprefix("./")] = md5
    return result


def parse_chrom_sizes(text: str, source: str = "chrom.sizes") -> dict[str, int]:
    """Parse a UCSC ``chrom.sizes`` table (``name<TAB>length`` per line) into ``{name: length}``.

    Raises:
        GenoctxError: a line without a name and a whole positive length.
    """
    sizes = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) < 2 or not parts[1].isdigit():
            raise GenoctxError(f"{source}: line {number} is not 'name<TAB>length': {line[:80]!r}")
        sizes[parts[0]] = int(parts[1])
    return sizes
