"""The field's names, for engines that switch to this library by changing imports.

An engine written against SGLang's disaggregation modules imports the same
names from here: :mod:`field.utils` stands for
``sglang.srt.disaggregation.utils``, :mod:`field.conn` for the connector
modules, :mod:`field.checksum` for the checksum module. Each name keeps the
field's parameters, defaults and return conventions and runs on the core
packages (:mod:`lifecycle`, :mod:`transport`, :mod:`buffers`), which never
import this one. Where two field releases disagree, :mod:`field.release`
says which one applies. docs/compat.md has one table per release.
"""
