"""The file's uses of transformers APIs that later releases removed, guarded (docs/compatibility.md)."""
