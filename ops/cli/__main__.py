"""``python -m ops.cli``: the console script ``dflashctl`` without installing it."""

if __name__ == "__main__":
    from ops.cli import main

    main()
