"""The sandbox: one Docker container and everything that bounds it (config, disk cap, mounts,
freezer, fence, ownership labels, death watch, output cap, tree hash)."""
