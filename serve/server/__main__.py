from serve.server.cli import main

raise SystemExit(main())
