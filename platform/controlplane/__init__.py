"""The odmoe control plane: a Django project that enrolls GPU boxes and runs the cluster."""
