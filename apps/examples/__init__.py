"""Runnable examples of embedding the SDK; each is `python -m mirrorsd.apps.examples.NAME --help`.

    generate_once      one-shot generate
    streaming          print tokens as they are committed
    chat_with_history  a multi-turn conversation kept as chat messages
    cancellation       stop a reply: close the stream, or cancel from another thread
    choose_devices     where the target and the drafter run
    read_stats         the speculation statistics of a request
    threads            one Engine shared by several threads (requests are serialized)
"""
