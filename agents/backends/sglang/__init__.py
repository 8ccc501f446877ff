"""The ``sglang`` node backend: SGLang's page objects in the node's local tier."""
