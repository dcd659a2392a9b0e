"""kvd's actors: one module, one task, one owner of its state each.

Actors talk only through bounded mailboxes (`Mailbox`); a request that needs an answer
carries a future (`Call`). See DESIGN.md for who owns what.
"""
