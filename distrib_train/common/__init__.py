"""Small helpers every layer may use; they import nothing else of the package.

- ``naming``: a pytree path as ``a/b/c`` (params, plan rows, checkpoint keys).
- ``text``: values cut for error messages, byte counts in their unit.
- ``yaml_loader``: safe, bounded YAML for the run and mesh configs.
- ``auto_mesh``: a mesh with Auto axis types.
- ``versions``: installed versions (jax's) and a GPU's compute capability as tuples of ints.
"""
