"""``python -m ops.cli``: the console script ``dflashctl`` without installing it (the same entry)."""

if __name__ == "__main__":
    from ops.console import main

    main()
