"""A folder laid out and updated the way the kubelet updates a mounted ConfigMap.

The kubelet's atomic writer (``pkg/volume/util/atomic_writer.go``) keeps each
version of the ConfigMap's files in a timestamped folder (``..2026_12_01_09_55_00.123``),
points the ``..data`` symlink at the current one, and gives each file a symlink
``name -> ..data/name``. An update writes a new timestamped folder, points a
temporary symlink at it, renames that onto ``..data`` (atomic), then deletes the
old folder. A file's own path never changes; what it leads to does.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from pathlib import Path


class ConfigMapDir:
    def __init__(self, mount: Path) -> None:
        self.mount = mount
        mount.mkdir(parents=True, exist_ok=True)
        self.versions = 0

    def write(self, files: dict[str, bytes]) -> None:
        """Publish a new version of the files, as one atomic swap of ``..data``."""
        now = datetime.datetime.now(datetime.timezone.utc)
        new = Path(tempfile.mkdtemp(prefix=f"..{now:%Y_%m_%d_%H_%M_%S}.", dir=self.mount))
        for name, data in files.items():
            (new / name).write_bytes(data)
        data_link = self.mount / "..data"
        old = data_link.readlink() if data_link.is_symlink() else None
        tmp = self.mount / "..data_tmp"
        os.symlink(new.name, tmp)
        os.replace(tmp, data_link)
        for name in files:
            link = self.mount / name
            if not link.is_symlink():
                os.symlink(f"..data/{name}", link)
        if old is not None:
            shutil.rmtree(self.mount / old)
        self.versions += 1

    def timestamped(self) -> list[Path]:
        return sorted(p for p in self.mount.iterdir() if p.name.startswith("..20"))
