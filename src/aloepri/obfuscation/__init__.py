"""The obfuscation method: parameters, secrets, pure transforms, block strategies, checkpoint I/O and the pipeline
driver (layer 2). Importing the package loads nothing heavy; import the submodule you need."""
