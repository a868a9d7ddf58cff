"""The disk tier: rows a bounded table evicts spill here (``disk.DiskTier``), into plain files read
with pread (``files``) or zarr3 arrays through tensorstore (``arrays``)."""
