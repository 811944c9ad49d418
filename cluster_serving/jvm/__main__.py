from cluster_serving.jvm import main

main()
