"""The backend: kernel specs, kinds and their argument contract, tiers, planning, the C printer, rendering
and NVRTC."""
