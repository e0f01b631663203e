"""The Mamba scans: SelectiveScan (Mamba-1) and SsdChunkScan (Mamba-2)."""
