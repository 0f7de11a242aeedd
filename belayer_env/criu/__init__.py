"""CRIU driven through runc: dump and restore of a container's process tree, the action-script
relay that runs code inside CRIU's freeze, and the cgroup yard its dumps need."""
