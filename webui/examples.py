"""Example inputs of the web demo, in Chinese and English. Each row: text, audio temperature, top_P, top_K,
audio seed, text seed, refine text."""

EXAMPLES = [
    ["今天的天气特别好，阳光很温暖。我们一起去公园散散步，顺便买一杯热奶茶吧。", 0.3, 0.7, 20, 2, 42, True],
    ["Good morning! Could you tell me how to get to the train station from here?", 0.3, 0.7, 20, 1024, 7, True],
    ["说起做饭，我最拿手的是西红柿炒鸡蛋[uv_break]，简单又好吃[laugh]，你也可以试试看。", 0.5, 0.6, 10, 333, 99, False],
    ["Text to speech has come a long way [uv_break]. Today a small model can laugh [laugh], pause "
     "[uv_break], and sound like a real conversation.", 0.4, 0.5, 10, 2222, 165, False],
]
