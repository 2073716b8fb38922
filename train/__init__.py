"""Training for jaxbnn (ships as ``jaxbnn.train``): dataset readers (``data``) and the loop (``loop``).

Import the submodules directly (``from jaxbnn.train import loop``); nothing is imported here so that
``jaxbnn --help`` stays fast.
"""
